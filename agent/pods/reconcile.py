"""Desired pods vs enrolled pods -> the steps that make them match (pure, no I/O).

Rules:
1. Pods are matched by `key` ("namespace/name"). A key only desired is
   `Enroll`ed; a key only enrolled is `Unenroll`ed.
2. Same key, different `uid` or `ip`: a new incarnation (new netns), so the
   old one is unenrolled and the new one enrolled, in that order (the new pod
   may reuse the name, never the old netns).
3. Same key and incarnation, other fields changed (annotations, ports,
   service account, labels): one `Update(old, new)`; the shell re-programs
   what depends on them (capture rules, pod state, policy watches, identity).
4. The plan is ordered: every `Unenroll` first (frees ports and identities),
   then `Update`s, then `Enroll`s, each group sorted by key, so that a plan is
   deterministic for the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from agent.pods.model import PodSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Enroll:
    """Capture this pod and start serving it."""

    pod: PodSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Unenroll:
    """Stop serving this pod and remove its capture."""

    pod: PodSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Update:
    """The same pod incarnation with changed settings."""

    old: PodSpec
    new: PodSpec


Step = Enroll | Unenroll | Update


def _by_key(pods: Iterable[PodSpec], what: str) -> dict[str, PodSpec]:
    out: dict[str, PodSpec] = {}
    for pod in pods:
        if pod.key in out and out[pod.key] != pod:
            raise ValueError(f"BUG: two {what} pods named {pod.key}")
        out[pod.key] = pod
    return out


def plan(desired: Iterable[PodSpec], actual: Iterable[PodSpec]) -> list[Step]:
    """The steps that turn `actual` (enrolled) into `desired`; see the module rules.

    Raises:
        ValueError: two different pods share a key within `desired` or `actual`.
    """
    want = _by_key(desired, "desired")
    have = _by_key(actual, "enrolled")
    unenroll: list[Step] = []
    update: list[Step] = []
    enroll: list[Step] = []
    for key in sorted(have.keys() | want.keys()):
        old, new = have.get(key), want.get(key)
        if new is None and old is not None:
            unenroll.append(Unenroll(pod=old))
        elif old is None and new is not None:
            enroll.append(Enroll(pod=new))
        elif old is not None and new is not None and old != new:
            if (old.uid, old.ip) != (new.uid, new.ip):
                unenroll.append(Unenroll(pod=old))
                enroll.append(Enroll(pod=new))
            else:
                update.append(Update(old=old, new=new))
    return unenroll + update + enroll

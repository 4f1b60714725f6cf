"""The enrolled-pods registry: /run/meshagent/enrolled.json.

Written by enroll and unenroll (any mode), read by `meshagent redirects` to know
which pods were enrolled, how, and with what spec. It is a hint, never the
truth: state always comes from the kernel, so a pod listed here whose rules
are gone shows up as drift.

Rules:
1. Writers take an exclusive `flock` on `<file>.lock`, read, change one entry
   and replace the file atomically (write a temp file, rename).
2. Entries are keyed by pod ("namespace/name"); one pod, one entry.
3. Unknown fields are ignored on read, so other modes can add their own.
4. A file that is there but is not a JSON object (another file named by mistake, a
   damaged one) is a `RegistryError` for readers and writers alike: never read as
   empty, never replaced, so nothing in it is lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import RegistryError
from agent.redirect.model import CaptureSpec, Mode, PortRange, PortSet

if TYPE_CHECKING:
    from collections.abc import Iterator

REGISTRY_PATH = Path("/run/meshagent/enrolled.json")


@dataclass(frozen=True, slots=True, kw_only=True)
class Enrollment:
    """One enrolled pod."""

    spec: CaptureSpec
    mode: Mode
    backend: str = ""  # iptables: nft | legacy
    writer: str = ""  # iptables: restore | iptc
    since: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pod(self) -> str:
        return self.spec.pod


def _ports(ps: PortSet) -> str:
    return str(ps)


def _parse_ports(text: str) -> PortSet:
    ranges = []
    for item in filter(None, text.split(",")):
        first, _, last = item.partition("-")
        ranges.append(PortRange(int(first), int(last or first)))
    return PortSet(tuple(ranges))


def spec_to_json(spec: CaptureSpec) -> dict[str, Any]:
    """A CaptureSpec as plain JSON values."""
    return {
        "pod": spec.pod,
        "netns": str(spec.netns),
        "pod_ip": spec.pod_ip,
        "cgroup": str(spec.cgroup) if spec.cgroup else None,
        "inbound_port": spec.inbound_port,
        "outbound_port": spec.outbound_port,
        "proxy_ports": list(spec.proxy_ports),
        "skip_inbound_ports": _ports(spec.skip_inbound_ports),
        "skip_outbound_ports": _ports(spec.skip_outbound_ports),
        "skip_subnets": [str(s) for s in spec.skip_subnets],
        "opaque_ports": _ports(spec.opaque_ports),
        "skip_accel_ports": _ports(spec.skip_accel_ports),
        "mark": spec.mark,
    }


def spec_from_json(d: dict[str, Any]) -> CaptureSpec:
    """The inverse of `spec_to_json`.

    Raises:
        KeyError, ValueError: a malformed entry.
    """
    return CaptureSpec(
        pod=d["pod"],
        netns=Path(d["netns"]),
        pod_ip=d["pod_ip"],
        cgroup=Path(d["cgroup"]) if d.get("cgroup") else None,
        inbound_port=int(d["inbound_port"]),
        outbound_port=int(d["outbound_port"]),
        proxy_ports=tuple(int(p) for p in d["proxy_ports"]),
        skip_inbound_ports=_parse_ports(d.get("skip_inbound_ports", "")),
        skip_outbound_ports=_parse_ports(d.get("skip_outbound_ports", "")),
        skip_subnets=tuple(ipaddress.ip_network(s) for s in d.get("skip_subnets", [])),
        opaque_ports=_parse_ports(d.get("opaque_ports", "")),
        skip_accel_ports=_parse_ports(d.get("skip_accel_ports", "")),
        mark=int(d["mark"]),
    )


def _to_json(e: Enrollment) -> dict[str, Any]:
    return {
        "mode": e.mode.value,
        "backend": e.backend,
        "writer": e.writer,
        "since": e.since,
        "spec": spec_to_json(e.spec),
        "extra": e.extra,
    }


def _from_json(d: dict[str, Any]) -> Enrollment:
    return Enrollment(
        spec=spec_from_json(d["spec"]),
        mode=Mode(d["mode"]),
        backend=d.get("backend", ""),
        writer=d.get("writer", ""),
        since=float(d.get("since", 0.0)),
        extra=d.get("extra", {}),
    )


class Registry:
    """The JSON file of enrolled pods."""

    def __init__(self, path: Path | str = REGISTRY_PATH) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with Path(f"{self.path}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _raw(self) -> dict[str, Any]:
        """The file's object; {} when there is no file.

        Raises:
            RegistryError: it is there but is not a JSON object (rule 4).
        """
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            raise RegistryError(str(self.path), f"cannot read: {exc}") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise self._not_one(f"not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise self._not_one("not a JSON object")
        return data

    def _not_one(self, why: str) -> RegistryError:
        return RegistryError(
            str(self.path),
            f"not a registry of enrolled pods: {why}; left as it is (move it away, or name "
            "another with --registry)",
        )

    def _write(self, data: dict[str, Any]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        tmp.replace(self.path)

    def load(self) -> dict[str, Enrollment]:
        """Every well-formed entry, by pod (malformed entries are skipped).

        Raises:
            RegistryError: the file is not a registry (rule 4).
        """
        out: dict[str, Enrollment] = {}
        for pod, d in self._raw().items():
            with contextlib.suppress(KeyError, ValueError, TypeError):
                out[pod] = _from_json(d)
        return out

    def check(self) -> None:
        """Before a capture is programmed: a registry `put` would refuse later.

        Raises:
            RegistryError: the file is not a registry (rule 4).
        """
        self._raw()

    def get(self, pod: str) -> Enrollment | None:
        return self.load().get(pod)

    def put(self, entry: Enrollment) -> None:
        """Add or replace the entry of `entry.pod`.

        Raises:
            RegistryError: the file is not a registry (rule 4).
        """
        with self._locked():
            data = self._raw()
            previous = data.get(entry.pod, {})
            record = _to_json(entry)
            if previous.get("spec") == record["spec"] and "since" in previous:
                record["since"] = previous["since"]
            data[entry.pod] = record
            self._write(data)

    def remove(self, pod: str) -> bool:
        """Drop `pod`'s entry; False if it had none.

        Raises:
            RegistryError: the file is not a registry (rule 4).
        """
        with self._locked():
            data = self._raw()
            if pod not in data:
                return False
            del data[pod]
            self._write(data)
            return True

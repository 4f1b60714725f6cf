"""What `meshagent stat`, `tap` and `diagnostics` do: talk to agents' admin servers.

Rules:
1. Agents: the `--admin` URLs given, else the local agent
   (`http://127.0.0.1:4191`) plus, when a sandbox is up, every sandbox
   agent's admin URL (`agent.sandbox.run.status()`). Agents that do not answer
   are skipped; none answering is an `AdminUnreachable`.
2. `tap` goes to the agent that serves the pod (found in the agents'
   `/config_dump`); `/tap` and PUT `/proxy-log-level` answer local callers
   only (agent.admin.server rule 1), so they work from the agent's own
   network namespace. A sandbox agent runs in its node's netns, so
   `connection` dials it there, on 127.0.0.1 (the sandbox binds its admin
   server on 0.0.0.0 inside that netns), from a socket made in that netns
   (`agent.redirect.netns.socket_in`); any other URL is dialled as given.
3. The `select_*` functions are pure: they pick from `/config_dump` documents.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

from agent.admin import stat
from agent.config import ADMIN_PORT
from agent.errors import AgentError

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from pathlib import Path

logger = logging.getLogger(__name__)

LOCAL_ADMIN = f"http://127.0.0.1:{ADMIN_PORT}"
TIMEOUT_S = 3.0
HTTP_OK = 200
HTTP_NO_CONTENT = 204
DIAGNOSTICS = ("endpoints", "profile", "policy", "certs")


class AdminUnreachable(AgentError):  # noqa: N818 - reads as a state
    """No agent admin server answered."""

    def __init__(self, urls: Sequence[str], reason: str) -> None:
        self.urls = list(urls)
        self.reason = reason
        super().__init__(f"no agent admin server answered ({', '.join(urls)}): {reason}")


def admin_urls(given: Sequence[str] | None = None) -> list[str]:
    """Rule 1: the URLs to ask."""
    if given:
        return [u if "://" in u else f"http://{u}" for u in given]
    urls = [LOCAL_ADMIN]
    try:
        from agent.sandbox import run  # noqa: PLC0415 - only when no URL is given

        info = run.status()
    except Exception:  # noqa: BLE001 - no sandbox is the common case
        return urls
    if info.get("up"):
        urls += [a["admin_url"] for a in info.get("agents", []) if a.get("admin_url")]
    return urls


def sandbox_netns(url: str) -> Path | None:
    """The node netns of the sandbox agent whose admin URL is `url`, if any (rule 2)."""
    try:
        from agent.redirect import netns  # noqa: PLC0415 - only for sandbox agents
        from agent.sandbox import run  # noqa: PLC0415

        info = run.status()
    except Exception:  # noqa: BLE001 - no sandbox is the common case
        return None
    netns_of = {n["name"]: n["netns"] for n in info.get("nodes", [])}
    want = _host_port(url)
    for agent in info.get("agents", []):
        if agent.get("admin_url") and _host_port(agent["admin_url"]) == want:
            name = netns_of.get(agent.get("node", ""))
            return netns.named_path(name) if name else None
    return None


def _host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    return (parts.hostname or "127.0.0.1", parts.port or ADMIN_PORT)


class _NetnsConnection(http.client.HTTPConnection):
    """HTTP to 127.0.0.1:`port` inside the namespace at `ns_path`."""

    def __init__(self, ns_path: Path, port: int, timeout: float | None) -> None:
        super().__init__("127.0.0.1", port, timeout=timeout)
        self.ns_path = ns_path

    def connect(self) -> None:
        from agent.redirect import netns  # noqa: PLC0415 - only for sandbox agents

        sock = netns.socket_in(self.ns_path)
        try:
            sock.settimeout(self.timeout)
            sock.connect((self.host, self.port))
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def connection(url: str, timeout: float | None = None) -> http.client.HTTPConnection:
    """An HTTP connection (not yet open) to the admin server at `url`; for a sandbox
    agent, from inside its node's netns to its loopback, so local-only endpoints
    answer (rule 2). Connecting may raise OSError or `agent.redirect.netns.NetnsError`."""
    host, port = _host_port(url)
    ns_path = sandbox_netns(url)
    if ns_path is not None:
        return _NetnsConnection(ns_path, port, timeout)
    return http.client.HTTPConnection(host, port, timeout=timeout)


def put_log_level(url: str, level: str) -> str:
    """PUT `/proxy-log-level` at the agent at `url` (local only: see `connection`);
    returns the agent's answer (empty on 204).

    Raises:
        AgentError: the agent refused the level.
        OSError: the agent did not answer.
    """
    conn = connection(url, timeout=TIMEOUT_S)
    try:
        conn.request("PUT", "/proxy-log-level", body=level.encode())
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace").strip()
        if resp.status not in (HTTP_OK, HTTP_NO_CONTENT):
            raise AgentError(f"log level at {url} refused ({resp.status}): {text}")
        return text
    finally:
        conn.close()


def _get(url: str, timeout: float = TIMEOUT_S) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - http(s) admin URLs
        body: bytes = resp.read()
        return body


def scrape(urls: Sequence[str]) -> stat.Scrape:
    """One scrape of every answering agent, merged.

    Raises:
        AdminUnreachable: none answered.
    """
    got: list[stat.Scrape] = []
    last = "no URL"
    for url in urls:
        try:
            text = _get(f"{url}/metrics").decode()
        except (OSError, ValueError) as exc:
            last = f"{url}: {exc}"
            continue
        got.append(stat.parse(text, time.time()))
    if not got:
        raise AdminUnreachable(urls, last)
    return stat.merge(got)


def stat_rows(
    kind: str, *, namespace: str | None, window_s: float, urls: Sequence[str]
) -> list[dict[str, Any]]:
    """Two scrapes `window_s` apart -> `stat.rows`.

    Raises:
        AdminUnreachable: no agent answered.
        ValueError: unknown `kind`.
    """
    before = scrape(urls)
    time.sleep(window_s)
    after = scrape(urls)
    return stat.rows(before, after, kind, namespace)


def config_dumps(urls: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """(url, /config_dump) of every answering agent.

    Raises:
        AdminUnreachable: none answered.
    """
    out: list[tuple[str, dict[str, Any]]] = []
    last = "no URL"
    for url in urls:
        try:
            out.append((url, json.loads(_get(f"{url}/config_dump"))))
        except (OSError, ValueError) as exc:
            last = f"{url}: {exc}"
    if not out:
        raise AdminUnreachable(urls, last)
    return out


# --- tap ----------------------------------------------------------------------------


def agent_of(pod: str, dumps: Sequence[tuple[str, dict[str, Any]]]) -> str | None:
    """The URL of the agent that serves `ns/name`."""
    for url, dump in dumps:
        if any(p.get("pod") == pod for p in dump.get("pods", [])):
            return url
    return None


def matches(event: dict[str, Any], *, to: str | None, path: str | None) -> bool:
    """`--to`: the authority (with or without port), destination address or pod;
    `--path`: a prefix of the request path."""
    if path is not None and not str(event.get("path", "")).startswith(path):
        return False
    if to is None:
        return True
    authority = str(event.get("authority", ""))
    names = {authority, authority.rpartition(":")[0], str(event.get("dst", ""))}
    names |= {str(event.get("dst_pod", "")), str(event.get("from_pod", ""))}
    host = authority.split(":", maxsplit=1)[0]
    return to in names or host.startswith(to + ".") or host == to


def tap(
    pod: str,
    *,
    urls: Sequence[str],
    to: str | None = None,
    path: str | None = None,
    max_events: int = 0,
) -> Iterator[dict[str, Any]]:
    """Live events of `pod` (ns/name) from its agent's `/tap`, filtered; stops after
    `max_events` (0: never).

    Raises:
        AdminUnreachable: no agent answered, or none serves `pod`.
        AgentError: the agent refused the tap, or its stream broke off or sent a line
            that is not a JSON object.
    """
    url = agent_of(pod, config_dumps(urls)) if len(urls) > 1 else urls[0]
    if url is None:
        raise AdminUnreachable(urls, f"no agent serves pod {pod}")
    conn = connection(url)
    try:
        try:
            conn.request("GET", "/tap?" + urllib.parse.urlencode({"pod": pod}))
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise AdminUnreachable([url], f"{url}: {exc}") from None
        if resp.status != HTTP_OK:
            reason = resp.read().decode(errors="replace").strip()
            raise AgentError(f"tap at {url} refused ({resp.status}): {reason}")
        sent = 0
        while max_events <= 0 or sent < max_events:
            event = _tap_event(url, resp)
            if event is None:
                return
            if "dropped" in event and len(event) == 1:
                yield event
                continue
            if matches(event, to=to, path=path):
                sent += 1
                yield event
    finally:
        conn.close()


def _tap_event(url: str, resp: http.client.HTTPResponse) -> dict[str, Any] | None:
    """The next event of a tap stream; None at its end.

    Raises:
        AgentError: the stream broke off, or its line is not a JSON object.
    """
    try:
        line = resp.readline()
    except (OSError, http.client.HTTPException) as exc:
        raise AgentError(f"tap at {url} broke off: {exc}") from None
    if not line:
        return None
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise AgentError(f"tap at {url} sent a line that is not a JSON object: {line[:120]!r}")
    return event


# --- diagnostics -------------------------------------------------------------------


def _destinations(
    dumps: Sequence[tuple[str, dict[str, Any]]], target: str
) -> list[tuple[str, str, dict[str, Any]]]:
    """(agent, key, destination) whose key or authority is `target` (port optional)."""
    out = []
    for url, dump in dumps:
        for key, dst in (dump.get("destinations") or {}).items():
            if dst is None:
                continue
            authority = str(dst.get("authority", ""))
            names = {key, authority, authority.rpartition(":")[0]}
            if target in names:
                out.append((url, key, dst))
    return out


def select(kind: str, target: str, dumps: Sequence[tuple[str, dict[str, Any]]]) -> Any:
    """What the agents believe about `target` (rule 3).

    endpoints/profile TARGET: a destination key (`ip:port`) or Service authority
    (`name.ns.svc.cluster.local[:port]`); policy TARGET: `ns/pod[:port]`;
    certs TARGET: `ns/pod`, an identity, or `all`.

    Raises:
        ValueError: unknown `kind`.
    """
    if kind == "endpoints":
        return [
            {"agent": url, "target": key, **ep}
            for url, key, dst in _destinations(dumps, target)
            for ep in dst.get("endpoint_details", [])
        ]
    if kind == "profile":
        return [
            {"agent": url, "target": key, "authority": dst.get("authority"), **_profile(dst)}
            for url, key, dst in _destinations(dumps, target)
        ]
    if kind == "policy":
        pod, _, port = target.partition(":")
        return [
            {"agent": url, "port": name.rpartition(":")[2], "policy": policy}
            for url, dump in dumps
            for name, policy in (dump.get("policies") or {}).items()
            if name.rpartition(":")[0] == pod and (not port or name.rpartition(":")[2] == port)
        ]
    if kind == "certs":
        return _certs(target, dumps)
    raise ValueError(f"diagnostics kind {kind!r} is not one of {', '.join(DIAGNOSTICS)}")


def _profile(dst: dict[str, Any]) -> dict[str, Any]:
    profile = dst.get("profile") or {}
    return {"profile": profile, "routes": [r.get("name") for r in profile.get("routes", [])]}


def _certs(target: str, dumps: Sequence[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for url, dump in dumps:
        idents = {target} | {
            p.get("identity") for p in dump.get("pods", []) if p.get("pod") == target
        }
        certs = dump.get("certificates", [])
        out.extend(
            {"agent": url, **c} for c in certs if target == "all" or c.get("identity") in idents
        )
    return out

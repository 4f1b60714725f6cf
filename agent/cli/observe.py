"""`meshagent stat`, `tap` and `diagnostics`: what running agents see, over their admin port.

Each noun reads agents' admin servers through agent.admin.client (`--admin URL`,
repeatable; by default the local agent and the sandbox's): `stat` diffs two
metric scrapes, `tap` streams live requests, `diagnostics` selects from the
agents' config dumps.

Rules, as for every noun module (agent.cli): one `register_<noun>(sub)` per
noun declares its parser, and its handler follows it. Handlers import their
modules lazily. Tables show rounded, human units; `-o json|yaml` gives the raw
values. `diagnostics` exits 1 when no agent knows the target.
"""

from __future__ import annotations

import argparse
import sys

from agent.cli import admin_flag, emit, output_flag
from agent.render import render


def register_stat(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_ = "success rate, rps, latency and TCP connections, like `linkerd viz stat`"
    parser = sub.add_parser("stat", help=help_, description=help_)
    parser.add_argument("kind", nargs="?", choices=["pods", "services", "routes"], default="pods")
    parser.add_argument("-n", "--namespace", help="only this namespace")
    parser.add_argument(
        "--window", default="10s", help="time between the two scrapes (default 10s)"
    )
    admin_flag(parser)
    output_flag(parser, ("table", "json", "yaml"))
    parser.set_defaults(handler=_stat)


def _stat(args: argparse.Namespace) -> int:
    from agent import config  # noqa: PLC0415 - lazy, see module docstring
    from agent.admin import client  # noqa: PLC0415
    from agent.errors import SettingError  # noqa: PLC0415

    try:
        window = config.parse_seconds(args.window)
    except ValueError as exc:
        raise SettingError("--window", args.window, str(exc)) from None
    rows = client.stat_rows(
        args.kind, namespace=args.namespace, window_s=window, urls=client.admin_urls(args.admin)
    )
    if args.output != "table":
        emit(rows, args)
        return 0
    shown = []
    for row in rows:
        out = {k: v for k, v in row.items() if not k.startswith("latency")}
        rate = row["success_rate"]
        out["success_rate"] = "-" if rate is None else f"{rate * 100:.2f}%"
        for q in ("p50", "p95", "p99"):
            value = row[f"latency_{q}_ms"]
            out[f"latency_{q}"] = "-" if value is None else f"{value:.0f}ms"
        shown.append(out)
    emit(shown, args)
    return 0


def register_tap(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_ = "live requests and responses of a pod, like `linkerd viz tap`"
    parser = sub.add_parser("tap", help=help_, description=help_)
    parser.add_argument("pod", metavar="POD", help="ns/name (or name with -n)")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("--to", help="only traffic to this authority, address or pod")
    parser.add_argument("--path", help="only requests whose path starts with this")
    parser.add_argument(
        "--max", type=_events, default=0, help="stop after N events (default: never)"
    )
    admin_flag(parser)
    output_flag(parser, ("table", "json"))
    parser.set_defaults(handler=_tap)


def _events(raw: str) -> int:
    """`--max`: a count of events, 0 for never stopping."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count of events: {raw!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (never stop) or more, got {value}")
    return value


def _tap(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415 - lazy, see module docstring

    from agent.admin import client  # noqa: PLC0415

    pod = args.pod if "/" in args.pod else f"{args.namespace}/{args.pod}"
    events = client.tap(
        pod, urls=client.admin_urls(args.admin), to=args.to, path=args.path, max_events=args.max
    )
    for ev in events:
        if args.output == "json":
            print(json.dumps(ev), flush=True)
        elif "dropped" in ev and len(ev) == 1:
            print(f"(dropped {ev['dropped']} events: reader too slow)", flush=True)
        else:
            ident = ev.get("client_id") if ev.get("direction") == "inbound" else ev.get("server_id")
            print(
                f"{ev.get('direction', '')[:3]} {ev.get('method')} {ev.get('authority')}"
                f"{ev.get('path')} :status={ev.get('status')} latency={ev.get('latency_ms')}ms"
                f" tls={ev.get('tls')} id={ident or '-'} src={ev.get('src')} dst={ev.get('dst')}",
                flush=True,
            )
    return 0


def register_diagnostics(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_ = "what the agent currently believes, like `linkerd diagnostics`"
    parser = sub.add_parser("diagnostics", help=help_, description=help_)
    parser.add_argument("kind", choices=["endpoints", "profile", "policy", "certs"])
    parser.add_argument(
        "target",
        metavar="TARGET",
        help="endpoints/profile: ip:port or name.ns.svc.cluster.local[:port]; "
        "policy: ns/pod[:port]; certs: ns/pod, an identity or all",
    )
    admin_flag(parser)
    output_flag(parser, ("table", "json", "yaml"))
    parser.set_defaults(handler=_diagnostics)


def _diagnostics(args: argparse.Namespace) -> int:
    """Exit 1 when no agent knows the target."""
    from agent.admin import client  # noqa: PLC0415 - lazy, see module docstring

    dumps = client.config_dumps(client.admin_urls(args.admin))
    found = client.select(args.kind, args.target, dumps)
    if args.output == "table" and args.kind in ("profile", "policy"):
        print(render(found, fmt="yaml"))  # nested documents read best as YAML
    else:
        emit(found, args)
    if not found:
        print(f"meshagent: no agent knows {args.kind} of {args.target}", file=sys.stderr)
    return 0 if found else 1

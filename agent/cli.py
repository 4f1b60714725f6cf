"""The `meshagent` command: parse, call one function, print.

Nouns with verbs (`meshagent certs create-root DIR`). Listings print a table by
default and `-o json|yaml` for machines. Every flag mirrors a `MESHAGENT_*`
variable (agent.config). Handlers import their modules lazily so that a quick
command does not pay for gRPC or bcc. Nothing imports this module.

Each noun has one `_noun_<name>(sub)` that declares its parser and verbs, and
its handlers below it, in one section per noun.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from agent import __version__
from agent.errors import AgentError
from agent.render import FORMATS, render

Handler = Callable[[argparse.Namespace], int]


def _output_flag(parser: argparse.ArgumentParser, formats: Sequence[str] = FORMATS) -> None:
    parser.add_argument(
        "-o", "--output", choices=list(formats), default="table", help="output format"
    )


def _print(data: object, args: argparse.Namespace, **kwargs: object) -> None:
    print(render(data, fmt=getattr(args, "output", "table"), **kwargs))  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree."""
    parser = argparse.ArgumentParser(
        prog="meshagent",
        description="A per-node service-mesh agent speaking Linkerd's proxy API.",
    )
    parser.add_argument("--version", action="version", version=f"meshagent {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("MESHAGENT_LOG_LEVEL", "info"),
        help="log level (debug, info, warning, error); env MESHAGENT_LOG_LEVEL",
    )
    sub = parser.add_subparsers(dest="noun", metavar="COMMAND", required=True)
    for register in NOUNS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `meshagent` and `python -m agent`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    handler: Handler = args.handler
    try:
        return handler(args)
    except AgentError as exc:
        print(f"meshagent: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


class _KeyValueFormatter(logging.Formatter):
    """`time level logger: message key=value ...` from `extra` fields."""

    _STD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in self._STD)
        return f"{base} {extra}" if extra else base


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if level.upper() in logging.getLevelNamesMapping() else "INFO")


def _verbs(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_: str
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    noun = sub.add_parser(name, help=help_, description=help_)
    return noun.add_subparsers(dest="verb", metavar="VERB", required=True)


# === controlplane ============================================================


def _noun_controlplane(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent import config  # noqa: PLC0415 - lazy, see module docstring

    help_ = "serve Destination, Identity and inbound policy from a manifests folder"
    noun = sub.add_parser("controlplane", help=help_, description=help_)
    config.add_options(noun, config.CONTROLPLANE_OPTIONS)
    noun.set_defaults(handler=_controlplane_serve)
    verbs = noun.add_subparsers(dest="verb", metavar="VERB", required=False)
    token = verbs.add_parser(
        "token", help="print a service-account token the control plane's Identity accepts"
    )
    token.add_argument("--namespace", required=True, help="service account namespace")
    token.add_argument("--serviceaccount", required=True, help="service account name")
    config.add_options(token, config.CONTROLPLANE_TOKEN_OPTIONS)
    token.set_defaults(handler=_controlplane_token)


def _controlplane_serve(args: argparse.Namespace) -> int:
    from agent import aio, config  # noqa: PLC0415 - lazy, see module docstring
    from agent.controlplane.app import ControlPlane  # noqa: PLC0415

    values = config.resolve(args, os.environ, config.CONTROLPLANE_OPTIONS)
    settings = config.ControlPlaneSettings.from_values(values)
    aio.run(ControlPlane(settings).serve())
    return 0


def _controlplane_token(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime, timedelta  # noqa: PLC0415

    from agent import config  # noqa: PLC0415 - lazy, see module docstring
    from agent.controlplane import tokens  # noqa: PLC0415
    from agent.errors import SettingError  # noqa: PLC0415
    from agent.identity.names import check_label  # noqa: PLC0415

    values = config.resolve(args, os.environ, config.CONTROLPLANE_TOKEN_OPTIONS)
    for flag, value in (("--namespace", args.namespace), ("--serviceaccount", args.serviceaccount)):
        try:
            check_label(flag.lstrip("-"), value)
        except ValueError as exc:
            raise SettingError(flag, value, str(exc)) from None
    token = tokens.mint(
        values["identity_dir"],
        args.namespace,
        args.serviceaccount,
        now=datetime.now(UTC),
        lifetime=timedelta(seconds=values["lifetime"]),
    )
    print(token)
    return 0


# === certs ====================================================================


def _noun_certs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent import config  # noqa: PLC0415 - lazy, see module docstring
    from agent.identity import options  # noqa: PLC0415

    verbs = _verbs(sub, "certs", "create and inspect the mesh PKI (trust anchor, identity issuer)")
    root = verbs.add_parser("create-root", help="create a trust anchor: DIR/ca.crt, DIR/ca.key")
    root.add_argument("dir", metavar="DIR")
    config.add_options(root, options.CREATE_ROOT)
    issuer = verbs.add_parser(
        "create-issuer", help="create an identity issuer: DIR/issuer.crt, issuer.key, ca.crt"
    )
    issuer.add_argument("dir", metavar="DIR")
    issuer.add_argument("--ca", required=True, metavar="DIR", help="directory of ca.crt/ca.key")
    config.add_options(issuer, options.CREATE_ISSUER)
    for parser, handler in ((root, _certs_create_root), (issuer, _certs_create_issuer)):
        parser.add_argument("--force", action="store_true", help="overwrite existing files")
        _output_flag(parser)
        parser.set_defaults(handler=handler)
    insp = verbs.add_parser("inspect", help="describe a certificate and whether it chains")
    insp.add_argument("file", metavar="FILE")
    insp.add_argument("--ca", metavar="FILE", help="trust bundle (default: ca.crt next to FILE)")
    _output_flag(insp)
    insp.set_defaults(handler=_certs_inspect)


def _certs_create_root(args: argparse.Namespace) -> int:
    from agent import config  # noqa: PLC0415 - lazy, see module docstring
    from agent.identity import ca, options  # noqa: PLC0415

    values = config.resolve(args, os.environ, options.CREATE_ROOT)
    created = ca.create_root(
        args.dir,
        lifetime=values["lifetime"],
        trust_domain=values["trust_domain"],
        force=args.force,
    )
    summary = created.summary()
    _print(summary, args, rows=summary["files"])
    return 0


def _certs_create_issuer(args: argparse.Namespace) -> int:
    from agent import config  # noqa: PLC0415 - lazy, see module docstring
    from agent.identity import ca, options  # noqa: PLC0415

    values = config.resolve(args, os.environ, options.CREATE_ISSUER)
    created = ca.create_issuer(args.dir, args.ca, lifetime=values["lifetime"], force=args.force)
    summary = created.summary()
    _print(summary, args, rows=summary["files"])
    return 0


def _certs_inspect(args: argparse.Namespace) -> int:
    """Exit 1 when a trust bundle was found or given and the certificate does not chain."""
    from agent.identity import ca  # noqa: PLC0415 - lazy, see module docstring

    info = ca.inspect(args.file, ca=args.ca)
    rows = [{"field": key, "value": value} for key, value in info.items()]
    _print(info, args, rows=rows)
    return 1 if info["chains"] is False else 0


# === redirects / check ========================================================


def _noun_redirects(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent.redirect import iptables  # noqa: PLC0415 - lazy, see module docstring

    verbs = _verbs(sub, "redirects", "pods' traffic capture, read from the kernel")
    ls = verbs.add_parser("list", help="one row per enrolled pod: state, skips, counters, drift")
    show = verbs.add_parser("show", help="the exact rules of one pod, as iptables-save prints them")
    show.add_argument("pod", metavar="POD")
    verify = verbs.add_parser("verify", help="probe a pod's capture with real connections")
    verify.add_argument("pod", metavar="POD")
    verify.add_argument("--probe", metavar="IP:PORT", help="outbound test address")
    enroll = verbs.add_parser("enroll", help="capture a pod's traffic (manual use and tests)")
    enroll.add_argument("pod", metavar="POD", help="namespace/name")
    enroll.add_argument("--netns", required=True, metavar="PATH", help="nsfs path of the pod")
    enroll.add_argument("--ip", required=True, metavar="IP", help="pod IP")
    enroll.add_argument("--annotations", nargs="*", default=[], metavar="K=V")
    enroll.add_argument("--mode", choices=["iptables", "ebpf"], default="iptables")
    enroll.add_argument("--cgroup", metavar="DIR", help="cgroup v2 directory (eBPF)")
    unenroll = verbs.add_parser("unenroll", help="remove a pod's capture")
    unenroll.add_argument("pod", metavar="POD")
    for parser, handler in (
        (ls, _redirects_list),
        (show, _redirects_show),
        (verify, _redirects_verify),
        (enroll, _redirects_enroll),
        (unenroll, _redirects_unenroll),
    ):
        iptables.add_options(parser)
        _output_flag(parser)
        parser.set_defaults(handler=handler)


def _redirects_list(args: argparse.Namespace) -> int:
    from agent.redirect import iptables  # noqa: PLC0415 - lazy, see module docstring

    settings = iptables.resolve_settings(args, os.environ)
    rows = [iptables.state_row(s) for s in iptables.list_enrolled(settings.registry)]
    cols = ["pod", "netns", "mode", "inbound", "outbound", "skipped", "in_packets", "out_packets"]
    if args.output == "wide":
        cols += ["in_bytes", "out_bytes", "backend", "drift"]
    elif any(r["drift"] for r in rows):
        cols.append("drift")
    _print(rows, args, columns=cols, rows=rows)
    return 0


def _redirects_show(args: argparse.Namespace) -> int:
    from agent.redirect import iptables  # noqa: PLC0415 - lazy, see module docstring

    settings = iptables.resolve_settings(args, os.environ)
    state = iptables.inspect_enrolled(settings.registry, args.pod)
    if args.output in ("json", "yaml"):
        _print({**iptables.state_row(state), "rules": state.detail.splitlines()}, args)
        return 0
    print(state.detail or "(no rules)")
    for line in state.drift:
        print(f"# drift: {line}")
    return 0


def _redirects_verify(args: argparse.Namespace) -> int:
    """Exit 1 when a probe did not reach the proxy port."""
    from agent import config  # noqa: PLC0415 - lazy, see module docstring
    from agent.errors import SettingError  # noqa: PLC0415
    from agent.redirect import check, iptables  # noqa: PLC0415

    settings = iptables.resolve_settings(args, os.environ)
    entry = iptables.require(settings.registry, args.pod)
    probe = None
    if args.probe:
        try:
            probe = config.parse_host_port(args.probe)
        except ValueError as exc:
            raise SettingError("--probe", args.probe, str(exc)) from None
    results = check.verify_pod(entry.spec, probe=probe)
    rows = [{"direction": r.name, "ok": r.ok, "detail": r.detail, "hint": r.hint} for r in results]
    ok = all(r.ok for r in results)
    _print({"pod": args.pod, "ok": ok, "probes": rows}, args, rows=rows)
    return 0 if ok else 1


def _redirects_enroll(args: argparse.Namespace) -> int:
    from pathlib import Path  # noqa: PLC0415 - lazy, see module docstring

    from agent.errors import SettingError  # noqa: PLC0415
    from agent.redirect import annotations, iptables  # noqa: PLC0415
    from agent.redirect.model import Mode  # noqa: PLC0415

    settings = iptables.resolve_settings(args, os.environ)
    ann = {}
    for item in args.annotations:
        key, sep, value = item.partition("=")
        if not sep:
            raise SettingError("--annotations", item, "expected KEY=VALUE")
        ann[key] = value
    spec = annotations.build_spec(
        pod=args.pod,
        netns=Path(args.netns),
        pod_ip=args.ip,
        pod_annotations=ann,
        cgroup=Path(args.cgroup) if args.cgroup else None,
    )
    red = iptables.redirector_for(
        Mode(args.mode),
        registry=settings.registry,
        iptables_mode=settings.iptables_mode,
        writer=settings.iptables_writer,
    )
    red.enroll(spec)
    row = iptables.state_row(red.inspect(spec))
    _print(row, args, rows=[row])
    return 0


def _redirects_unenroll(args: argparse.Namespace) -> int:
    from agent.redirect import iptables  # noqa: PLC0415 - lazy, see module docstring

    settings = iptables.resolve_settings(args, os.environ)
    entry = iptables.require(settings.registry, args.pod)
    red = iptables.redirector_for(
        entry.mode,
        registry=settings.registry,
        iptables_mode=settings.iptables_mode,
        writer=entry.writer or settings.iptables_writer,
    )
    red.unenroll(entry.spec)
    row = {"pod": args.pod, "unenrolled": True}
    _print(row, args, rows=[row])
    return 0


def _noun_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "check",
        help="preflight: can this node capture pods' traffic?",
        description="preflight like `linkerd check --pre`: kernel, cgroup v2, iptables, eBPF",
    )
    _output_flag(parser, ("table", "json", "yaml"))
    parser.set_defaults(handler=_check)


def _check(args: argparse.Namespace) -> int:
    """Exit 1 when an iptables-mode check fails (eBPF failures only change `auto`)."""
    from agent.redirect import check  # noqa: PLC0415 - lazy, see module docstring
    from agent.render import table  # noqa: PLC0415

    core = check.node_checks()
    ebpf = check.ebpf_checks()
    mode, reason = check.auto_mode(ebpf)
    rows = [
        {"status": "pass" if r.ok else "fail", "check": r.name, "detail": r.detail, "hint": r.hint}
        for r in [*core, *(ebpf or [])]
    ]
    ok = all(r.ok for r in core)
    if args.output == "table":
        print(table(rows))
        print(f"\n--redirect auto would pick: {mode} ({reason})")
        print("status: " + ("ok" if ok else "FAILED"))
    else:
        _print({"ok": ok, "checks": rows, "redirect_auto": {"mode": mode, "reason": reason}}, args)
    return 0 if ok else 1


# === NOUNS (keep last) ========================================================

NOUNS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _noun_controlplane,
    _noun_redirects,
    _noun_check,
    _noun_certs,
]

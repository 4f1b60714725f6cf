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
    accel = state.extra.get("acceleration")  # eBPF mode only
    if args.output in ("json", "yaml"):
        view = {**iptables.state_row(state), "rules": state.detail.splitlines()}
        if accel is not None:
            view["acceleration"] = accel
        _print(view, args)
        return 0
    print(state.detail or "(no rules)")
    if accel is not None:
        from agent.redirect import ebpf_inspect  # noqa: PLC0415

        print("\n".join(ebpf_inspect.acceleration_lines(accel)))
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


# === run ======================================================================


def _noun_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent import config  # noqa: PLC0415 - lazy, see module docstring
    from agent.redirect import iptables  # noqa: PLC0415
    from agent.supervisor.settings import RUN_OPTIONS  # noqa: PLC0415

    help_ = "run the node agent: capture meshed pods, serve them from a worker pool"
    parser = sub.add_parser("run", help=help_, description=help_)
    config.add_options(parser, RUN_OPTIONS)
    parser.add_argument(
        "--cleanup-on-exit",
        action="store_true",
        default=os.environ.get("MESHAGENT_CLEANUP_ON_EXIT", "") in ("1", "true"),
        help="unenroll every pod on exit (tests); by default redirects stay for the next run",
    )
    iptables.add_options(parser)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from agent import aio, config  # noqa: PLC0415 - lazy, see module docstring
    from agent.redirect import iptables  # noqa: PLC0415
    from agent.supervisor.core import Supervisor  # noqa: PLC0415
    from agent.supervisor.settings import RUN_OPTIONS, RunSettings  # noqa: PLC0415

    values = config.resolve(args, os.environ, RUN_OPTIONS)
    values["cleanup_on_exit"] = args.cleanup_on_exit
    settings = RunSettings.from_values(values, log_level=args.log_level)
    redirect = iptables.resolve_settings(args, os.environ)
    supervisor = Supervisor(
        settings,
        registry=redirect.registry,
        iptables_mode=redirect.iptables_mode,
        iptables_writer=redirect.iptables_writer,
    )
    return aio.run(supervisor.run())


# === sandbox ==================================================================


def _noun_sandbox(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verbs = _verbs(sub, "sandbox", "the whole mesh on this machine: nodes, pods, agents, traffic")
    up = verbs.add_parser("up", help="build the sandbox (idempotent)")
    up.add_argument("--manifests", metavar="DIR", help="manifests folder (default: examples/)")
    up.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    up.add_argument("--redirect", choices=["iptables", "ebpf", "auto"], default="auto")
    up.add_argument("--identity-dir", metavar="DIR", help="existing PKI (default: made in /run)")
    up.add_argument("--no-agents", action="store_true", help="pods without the mesh")
    when = up.add_mutually_exclusive_group()
    when.add_argument(
        "--duration", type=float, metavar="S", help="drive traffic S seconds, then down"
    )
    when.add_argument("--detach", action="store_true", help="return once ready, leave it running")
    up.set_defaults(handler=_sandbox_up)
    st = verbs.add_parser("status", help="nodes, agents and pods")
    _output_flag(st)
    st.set_defaults(handler=_sandbox_status)
    dn = verbs.add_parser("down", help="remove everything the sandbox made")
    dn.set_defaults(handler=_sandbox_down)
    vw = verbs.add_parser("view", help="drive traffic and show the live view on a running sandbox")
    vw.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    vw.set_defaults(handler=_sandbox_view)
    ex = verbs.add_parser(
        "exec", help="run a command inside a pod (its netns and cgroup), like kubectl exec"
    )
    ex.add_argument("pod", metavar="POD", help="ns/name, name, or a unique prefix (shop/web)")
    ex.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    ex.set_defaults(handler=_sandbox_exec)


def _sandbox_exec(args: argparse.Namespace) -> int:
    """Replaces this process with the command; returns only on error."""
    import json  # noqa: PLC0415 - lazy, see module docstring

    from agent.sandbox import podexec, run  # noqa: PLC0415

    state = json.loads(run.STATE_FILE.read_text()) if run.STATE_FILE.exists() else {}
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    podexec.exec_in_pod(podexec.find_pod(state, args.pod), command)
    return 0


def _sandbox_view(args: argparse.Namespace) -> int:
    """Exit 1 (with a hint) when no sandbox is up; the sandbox stays up afterwards."""
    from agent.sandbox import run  # noqa: PLC0415 - lazy, see module docstring

    return run.view(args.duration)


def _sandbox_up(args: argparse.Namespace) -> int:
    from pathlib import Path  # noqa: PLC0415 - lazy, see module docstring

    from agent.sandbox import run  # noqa: PLC0415

    opts = run.UpOptions(
        manifests=Path(args.manifests) if args.manifests else run.EXAMPLES,
        nodes=args.nodes,
        redirect=args.redirect,
        duration=args.duration,
        detach=args.detach,
        identity_dir=Path(args.identity_dir) if args.identity_dir else None,
        agents=False if args.no_agents else None,
        progress=lambda msg: print(f"  {msg}", flush=True),
    )
    print("meshagent sandbox: building", flush=True)
    info = run.up(opts)
    print(run.hints(info))
    if opts.detach:
        return 0
    return run.foreground(opts)


def _sandbox_status(args: argparse.Namespace) -> int:
    """Exit 1 when no sandbox is up."""
    from agent.render import table  # noqa: PLC0415 - lazy, see module docstring
    from agent.sandbox import run  # noqa: PLC0415

    info = run.status()
    if args.output != "table":
        _print(info, args)
    else:
        print(f"sandbox: {'up' if info['up'] else 'down'} (redirect {info.get('redirect')})")
        for key in ("nodes", "agents", "pods"):
            if info[key]:
                print(f"\n{key.upper()}\n{table(info[key])}")
    return 0 if info["up"] else 1


def _sandbox_down(_args: argparse.Namespace) -> int:
    """Exit 1 when something could not be removed (each is printed)."""
    from agent.sandbox import run  # noqa: PLC0415 - lazy, see module docstring

    errors = run.down(lambda msg: print(f"  {msg}", flush=True))
    for err in errors:
        print(f"meshagent: sandbox down: {err}", file=sys.stderr)
    print("sandbox: down" if not errors else "sandbox: down, with errors")
    return 1 if errors else 0


# === bench ====================================================================


def _noun_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_ = "benchmark meshagent against direct and HAProxy in one run, reported as ratios"
    parser = sub.add_parser("bench", help=help_, description=help_)
    parser.add_argument("--quick", action="store_true", help="short loads (about two minutes)")
    parser.add_argument("--setups", metavar="A,B", help="setups to run (default: all)")
    parser.add_argument("--loads", metavar="X,Y", help="loads (http1-rate picks every rate)")
    parser.add_argument(
        "--duration",
        type=float,
        metavar="S",
        default=float(os.environ.get("MESHAGENT_BENCH_DURATION", "0")) or None,
        help="seconds per load; env MESHAGENT_BENCH_DURATION",
    )
    parser.add_argument("--out", metavar="DIR", help="write bench.json and bench.png here")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every setup's loads N times, alternating setups; report medians",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the node agents' workers; per-setup summaries in DIR/profile/ (slower)",
    )
    _output_flag(parser, ("table", "json"))
    parser.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415 - lazy, see module docstring
    from pathlib import Path  # noqa: PLC0415

    from agent.bench import harness, report  # noqa: PLC0415
    from agent.errors import SettingError  # noqa: PLC0415
    from agent.render import table  # noqa: PLC0415

    out = Path(args.out) if args.out else Path.cwd()
    try:
        opts = harness.Options.make(
            quick=args.quick,
            setups_=args.setups,
            loads_=args.loads,
            duration_s=args.duration,
            profile_dir=(out / "profile").resolve() if args.profile else None,
            repeat=args.repeat,
        )
    except ValueError as exc:
        flag = "--repeat" if args.repeat < 1 else "--setups/--loads"
        value = str(args.repeat) if args.repeat < 1 else f"{args.setups},{args.loads}"
        raise SettingError(flag, value, str(exc)) from None
    quiet = args.output == "json"
    doc = harness.run(opts, progress=None if quiet else lambda m: print(f"  {m}", flush=True))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(doc, indent=1) + "\n")
    if quiet:
        print(json.dumps(doc, indent=1))
        return 0
    why_not = report.plot(doc, str(out / "bench.png"))
    print(table(report.table_rows(doc)))
    print("\nratios (meshagent / peer):")
    for key, value in doc["ratios"].items():
        print(f"  {key} = {value}")
    for key, value in doc["memory"].items():
        print(f"  memory {key}: {value}")
    for note in [*doc["notes"], why_not or f"plot: {out / 'bench.png'}", f"json: {out}/bench.json"]:
        print(f"note: {note}")
    return 0


# === stat / tap / diagnostics ===============================================


def _admin_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin",
        action="append",
        metavar="URL",
        help="agent admin URL (repeatable; default: 127.0.0.1:4191 and the sandbox's agents)",
    )


def _noun_stat(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_ = "success rate, rps, latency and TCP connections, like `linkerd viz stat`"
    parser = sub.add_parser("stat", help=help_, description=help_)
    parser.add_argument("kind", nargs="?", choices=["pods", "services", "routes"], default="pods")
    parser.add_argument("-n", "--namespace", help="only this namespace")
    parser.add_argument(
        "--window", default="10s", help="time between the two scrapes (default 10s)"
    )
    _admin_flag(parser)
    _output_flag(parser, ("table", "json", "yaml"))
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
        _print(rows, args)
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
    _print(shown, args)
    return 0


def _noun_tap(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_ = "live requests and responses of a pod, like `linkerd viz tap`"
    parser = sub.add_parser("tap", help=help_, description=help_)
    parser.add_argument("pod", metavar="POD", help="ns/name (or name with -n)")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("--to", help="only traffic to this authority, address or pod")
    parser.add_argument("--path", help="only requests whose path starts with this")
    parser.add_argument("--max", type=int, default=0, help="stop after N events (default: never)")
    _admin_flag(parser)
    _output_flag(parser, ("table", "json"))
    parser.set_defaults(handler=_tap)


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


def _noun_diagnostics(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_ = "what the agent currently believes, like `linkerd diagnostics`"
    parser = sub.add_parser("diagnostics", help=help_, description=help_)
    parser.add_argument("kind", choices=["endpoints", "profile", "policy", "certs"])
    parser.add_argument(
        "target",
        metavar="TARGET",
        help="endpoints/profile: ip:port or name.ns.svc.cluster.local[:port]; "
        "policy: ns/pod[:port]; certs: ns/pod, an identity or all",
    )
    _admin_flag(parser)
    _output_flag(parser, ("table", "json", "yaml"))
    parser.set_defaults(handler=_diagnostics)


def _diagnostics(args: argparse.Namespace) -> int:
    """Exit 1 when no agent knows the target."""
    from agent.admin import client  # noqa: PLC0415 - lazy, see module docstring

    dumps = client.config_dumps(client.admin_urls(args.admin))
    found = client.select(args.kind, args.target, dumps)
    if args.output == "table" and args.kind in ("profile", "policy"):
        print(render(found, fmt="yaml"))  # nested documents read best as YAML
    else:
        _print(found, args)
    if not found:
        print(f"meshagent: no agent knows {args.kind} of {args.target}", file=sys.stderr)
    return 0 if found else 1


# === NOUNS (keep last) ========================================================

NOUNS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _noun_controlplane,
    _noun_redirects,
    _noun_check,
    _noun_certs,
    _noun_run,
    _noun_sandbox,
    _noun_bench,
    _noun_stat,
    _noun_tap,
    _noun_diagnostics,
]

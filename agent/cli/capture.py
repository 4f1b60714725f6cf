"""`meshagent redirects` and `check`: pods' traffic capture and whether the node can do it.

`redirects` reads the capture from the kernel (list, show), probes it with real
connections (verify), and applies or removes it by hand (enroll, unenroll);
`check` is the preflight that says which redirect mode this node supports.

Rules, as for every noun module (agent.cli): one `register_<noun>(sub)` per
noun declares its parser and verbs, and its handlers follow it. Parsers and
handlers import their modules lazily, so that a quick command does not pay for
bcc. The iptables flags come from agent.redirect.iptables. `verify` and `check`
exit 1 when what they test fails.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from agent.cli import add_verbs, emit, output_flag

if TYPE_CHECKING:
    import argparse


# === redirects ===============================================================


def register_redirects(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent.redirect import iptables  # noqa: PLC0415 - lazy, see module docstring

    verbs = add_verbs(sub, "redirects", "pods' traffic capture, read from the kernel")
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
        output_flag(parser)
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
    emit(rows, args, columns=cols, rows=rows)
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
        emit(view, args)
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
    emit({"pod": args.pod, "ok": ok, "probes": rows}, args, rows=rows)
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
    emit(row, args, rows=[row])
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
    emit(row, args, rows=[row])
    return 0


# === check ===================================================================


def register_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "check",
        help="preflight: can this node capture pods' traffic?",
        description="preflight like `linkerd check --pre`: kernel, cgroup v2, iptables, eBPF",
    )
    output_flag(parser, ("table", "json", "yaml"))
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
        emit({"ok": ok, "checks": rows, "redirect_auto": {"mode": mode, "reason": reason}}, args)
    return 0 if ok else 1

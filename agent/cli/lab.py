"""`meshagent sandbox` and `bench`: the whole mesh on this machine, and its benchmark.

`sandbox` builds simulated nodes and pods with agents and traffic (up, status,
view, exec, down); `bench` runs meshagent against direct connections and HAProxy
and reports ratios.

Rules, as for every noun module (agent.cli): one `register_<noun>(sub)` per
noun declares its parser and verbs, and its handlers follow it. Handlers import
their modules lazily, so that a quick command does not pay for the lab. Progress
lines go to stdout as they happen (flushed); `sandbox status` and `sandbox down`
exit 1 when no sandbox is up or something could not be removed.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from agent.cli import add_verbs, arg_type, emit, flag_or_env, output_flag
from agent.config import parse_positive_seconds, parse_seconds

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

# === sandbox ==================================================================


def register_sandbox(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verbs = add_verbs(
        sub, "sandbox", "the whole mesh on this machine: nodes, pods, agents, traffic"
    )
    up = verbs.add_parser("up", help="build the sandbox (idempotent)")
    up.add_argument("--manifests", metavar="DIR", help="manifests folder (default: examples/)")
    up.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    up.add_argument("--redirect", choices=["iptables", "ebpf", "auto"], default="auto")
    up.add_argument("--identity-dir", metavar="DIR", help="existing PKI (default: made in /run)")
    up.add_argument("--no-agents", action="store_true", help="pods without the mesh")
    when = up.add_mutually_exclusive_group()
    when.add_argument(
        "--duration",
        type=arg_type(parse_positive_seconds),
        metavar="S",
        help="drive traffic S seconds (30, 2m), then down",
    )
    when.add_argument("--detach", action="store_true", help="return once ready, leave it running")
    up.set_defaults(handler=_sandbox_up)
    st = verbs.add_parser("status", help="nodes, agents and pods")
    output_flag(st)
    st.set_defaults(handler=_sandbox_status)
    dn = verbs.add_parser("down", help="remove everything the sandbox made")
    dn.set_defaults(handler=_sandbox_down)
    vw = verbs.add_parser("view", help="drive traffic and show the live view on a running sandbox")
    vw.add_argument(
        "--duration",
        type=arg_type(parse_positive_seconds),
        metavar="S",
        help="stop after S seconds (30, 2m)",
    )
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
    with _terminate_as_interrupt():  # a build interrupted, or the foreground, ends in down
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
        emit(info, args)
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


def register_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_ = "benchmark meshagent against direct and HAProxy in one run, reported as ratios"
    parser = sub.add_parser("bench", help=help_, description=help_)
    parser.add_argument("--quick", action="store_true", help="short loads (about 2 minutes)")
    parser.add_argument("--setups", metavar="A,B", help="setups to run (default: all)")
    parser.add_argument("--loads", metavar="X,Y", help="loads (http1-rate picks every rate)")
    parser.add_argument(
        "--duration",
        metavar="S",
        help=f"seconds per load (30, 1.5, 500ms, 2m); env {ENV_DURATION}",
    )
    parser.add_argument(
        "--warmup",
        metavar="S",
        help="unmeasured seconds before each load: the rate loads' generator warms up, a "
        "saturating load runs once first when 1 s or more (default 2, --quick 0.3; 0: none)",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="write bench.json and bench.png here (made before the run)"
    )
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
    parser.add_argument(
        "--interp",
        action="store_true",
        help="count the interpreted calls of the node agents' workers; per-setup summaries "
        "in DIR/interp/",
    )
    parser.add_argument(
        "--icount",
        action="store_true",
        help="run the node agents' workers under callgrind and count their instructions per "
        "request (rows' `icount`; dumps in DIR/icount/; needs valgrind, loads of 20 s or more, "
        "default 60 s; rates not comparable)",
    )
    parser.add_argument(
        "--placement",
        choices=("split", "shared"),
        help="split: each simulated node on its own share of the CPUs (default); shared: "
        f"the scheduler places every process anywhere; env {ENV_PLACEMENT}",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="also run every meshagent setup with these environment variables set for its "
        "node agents, alternating with the agents as they are (base) in each round; "
        "reported as variant/base per round (repeatable; use with --repeat)",
    )
    output_flag(parser, ("table", "json"))
    parser.set_defaults(handler=_bench)


ENV_DURATION = "MESHAGENT_BENCH_DURATION"
ENV_PLACEMENT = "MESHAGENT_BENCH_PLACEMENT"


def _bench_duration(args: argparse.Namespace) -> float | None:
    """`--duration` (or its variable) in seconds; None: the run's default.

    Raises:
        SettingError: not a duration above zero.
    """
    from agent.errors import SettingError  # noqa: PLC0415

    raw, source = flag_or_env(args.duration, "--duration", ENV_DURATION)
    if raw is None:
        return None
    try:
        return parse_positive_seconds(raw)
    except ValueError as exc:
        raise SettingError(source, raw, str(exc)) from None


def _bench_warmup(args: argparse.Namespace) -> float | None:
    """`--warmup` in seconds; None: the run's default.

    Raises:
        SettingError: not a duration (0 or more).
    """
    from agent.errors import SettingError  # noqa: PLC0415

    if args.warmup is None:
        return None
    try:
        return parse_seconds(args.warmup)
    except ValueError as exc:
        raise SettingError("--warmup", args.warmup, str(exc)) from None


def _make_out(out: Path) -> None:
    """Make `--out` before the run: a run of 20 minutes must not find it unusable at
    the end.

    Raises:
        SettingError: it cannot be made, or is not a writable directory.
    """
    from agent.errors import SettingError  # noqa: PLC0415

    if out.exists() and not out.is_dir():
        raise SettingError("--out", str(out), "not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SettingError("--out", str(out), exc.strerror or str(exc)) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise SettingError("--out", str(out), "not a directory this user may write in")


def _bad_flag(args: argparse.Namespace, why: str) -> tuple[str, str]:
    """The flag (or variable) and value that `harness.Options.make` refused with `why`."""
    if args.repeat < 1:
        return "--repeat", str(args.repeat)
    if why.startswith("--placement"):
        raw, source = flag_or_env(args.placement, "--placement", ENV_PLACEMENT)
        return source, str(raw)
    if why.startswith("--icount"):
        raw, source = flag_or_env(args.duration, "--duration", ENV_DURATION)
        return source, str(raw)
    if why.startswith("--variant"):
        return "--variant", " ".join(args.variant)
    return "--setups/--loads", f"{args.setups},{args.loads}"


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt here, as Ctrl-C does, so the command's cleanup
    runs (a bench's node agents, HAProxy and load processes stopped and its lab removed;
    a sandbox taken down); Python's default for SIGTERM is to die on the spot and leave
    them all behind.

    Python runs a signal's handler in whatever Python code the main thread runs next,
    and where that code can only print an exception (a fork hook, such as logging's
    after every fork; a `__del__`), the interrupt is lost: CI once saw a SIGTERM sent
    while the sandbox forked an agent ignored, and the sandbox built and ran on. The
    unraisable hook sees such a lost interrupt and interrupts the main thread again
    from a short-lived thread (the hook itself is such a place too)."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous_hook = sys.unraisablehook

    def lost(unraisable: sys.UnraisableHookArgs) -> None:
        if unraisable.exc_type is not KeyboardInterrupt:
            previous_hook(unraisable)
            return
        again = threading.Timer(0.01, _thread.interrupt_main, (signal.SIGTERM,))
        again.daemon = True
        again.start()

    previous = signal.signal(signal.SIGTERM, interrupt)
    sys.unraisablehook = lost
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous)


def _bench(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415 - lazy, see module docstring
    from pathlib import Path  # noqa: PLC0415

    from agent.bench import harness, report  # noqa: PLC0415
    from agent.errors import SettingError  # noqa: PLC0415

    out = Path(args.out) if args.out else Path.cwd()
    placement, _ = flag_or_env(args.placement, "--placement", ENV_PLACEMENT)
    try:
        opts = harness.Options.make(
            quick=args.quick,
            setups_=args.setups,
            loads_=args.loads,
            duration_s=_bench_duration(args),
            warmup_s=_bench_warmup(args),
            profile_dir=(out / "profile").resolve() if args.profile else None,
            interp_dir=(out / "interp").resolve() if args.interp else None,
            icount_dir=(out / "icount").resolve() if args.icount else None,
            repeat=args.repeat,
            placement=placement or "split",
            variants=args.variant,
        )
    except ValueError as exc:
        raise SettingError(*_bad_flag(args, str(exc)), str(exc)) from None
    _make_out(out)
    quiet = args.output == "json"
    with _terminate_as_interrupt():
        doc = harness.run(opts, progress=None if quiet else lambda m: print(f"  {m}", flush=True))
    text = json.dumps(doc, indent=1) + "\n"
    try:
        (out / "bench.json").write_text(text)
    except OSError as exc:  # gone or full since the start: the run is printed, not lost
        print(text, end="")
        print(f"meshagent: bench: {out / 'bench.json'}: {exc}", file=sys.stderr)
        return 1
    if quiet:
        print(text, end="")
        return 0
    why_not = report.plot(doc, str(out / "bench.png"))
    _print_bench(doc)
    for note in [*doc["notes"], why_not or f"plot: {out / 'bench.png'}", f"json: {out}/bench.json"]:
        print(f"note: {note}")
    return 0


def _print_bench(doc: dict[str, Any]) -> None:
    """The bench's table, ratios, memory, goals and variants (not its notes)."""
    from agent.bench import goals, report  # noqa: PLC0415 - lazy, see module docstring
    from agent.render import table  # noqa: PLC0415

    print(table(report.table_rows(doc)))
    print("\nratios (meshagent / peer):")
    for key, value in doc["ratios"].items():
        print(f"  {key} = {value}")
    if doc["ratios_paired"]:
        print("\nratios within each round, median over rounds (steadier on a drifting machine):")
        for key, value in doc["ratios_paired"].items():
            print(f"  {key} = {value}")
    for key, value in doc["memory"].items():
        print(f"  memory {key}: {value}")
    print("\ngoals (bench/README.md):")
    if doc.get("goals_caveat"):
        print(f"  ({doc['goals_caveat']})")
    for line in goals.lines(doc["goals"]):
        print(f"  {line}")
    if doc.get("variants"):
        print("\nvariants, variant/base within each round, median over rounds:")
        for line in report.variant_lines(doc["variants"]):
            print(f"  {line}")

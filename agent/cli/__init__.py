"""The `meshagent` command: parse, call one function, print.

Nouns with verbs (`meshagent certs create-root DIR`). Listings print a table by
default and `-o json|yaml` for machines. Every flag mirrors a `MESHAGENT_*`
variable (agent.config). Handlers import their modules lazily so that a quick
command does not pay for gRPC or bcc. Nothing in agent imports this package
but `agent.__main__`; the `meshagent` entry point is `agent.cli:main`.

This module is the top: `main`, `build_parser`, logging (`agent.logs`), and the helpers the
nouns share. The nouns live in one module per group; each noun has one
`register_<noun>(sub)` that declares its parser and verbs, with its handlers
below it:

    mesh      controlplane, certs, run
    capture   redirects, check
    lab       sandbox, bench
    observe   stat, tap, diagnostics

`_nouns()` lists them in `meshagent --help` order; a new noun goes there too.
The noun modules import their helpers from here, so this module imports them
only inside `_nouns()`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from agent import __version__, logs
from agent.errors import AgentError, SettingError
from agent.render import FORMATS, render

Handler = Callable[[argparse.Namespace], int]
ENV_LOG_LEVEL = "MESHAGENT_LOG_LEVEL"


def output_flag(parser: argparse.ArgumentParser, formats: Sequence[str] = FORMATS) -> None:
    parser.add_argument(
        "-o", "--output", choices=list(formats), default="table", help="output format"
    )


def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` from one of agent.config's parsers: its ValueError's reason
    becomes argparse's message (`argument --duration: not a finite duration: 'nan'`)."""

    def convert(raw: str) -> Any:
        try:
            return parse(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}: {raw!r}") from None

    return convert


def admin_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin",
        action="append",
        metavar="URL",
        help="agent admin URL (repeatable; default: 127.0.0.1:4191 and the sandbox's agents)",
    )


def emit(data: object, args: argparse.Namespace, **kwargs: object) -> None:
    print(render(data, fmt=getattr(args, "output", "table"), **kwargs))  # type: ignore[arg-type]


def add_verbs(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_: str
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    noun = sub.add_parser(name, help=help_, description=help_)
    return noun.add_subparsers(dest="verb", metavar="VERB", required=True)


def _nouns() -> list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]]:
    """Every noun's `register_<noun>`, in `meshagent --help` order."""
    from agent.cli import capture, lab, mesh, observe  # noqa: PLC0415 - they import this module

    return [
        mesh.register_controlplane,
        capture.register_redirects,
        capture.register_check,
        mesh.register_certs,
        mesh.register_run,
        lab.register_sandbox,
        lab.register_bench,
        observe.register_stat,
        observe.register_tap,
        observe.register_diagnostics,
    ]


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree."""
    parser = argparse.ArgumentParser(
        prog="meshagent",
        description="A per-node service-mesh agent speaking Linkerd's proxy API.",
    )
    parser.add_argument("--version", action="version", version=f"meshagent {__version__}")
    parser.add_argument(
        "--log-level",
        help=f"log level ({', '.join(logs.LEVELS)}; default info); env {ENV_LOG_LEVEL}",
    )
    sub = parser.add_subparsers(dest="noun", metavar="COMMAND", required=True)
    for register in _nouns():
        register(sub)
    return parser


def flag_or_env(value: str | None, flag: str, env: str) -> tuple[str | None, str]:
    """A flag's text and where it came from: the flag, else its variable, else None."""
    if value is not None:
        return value, flag
    if env in os.environ:
        return os.environ[env], env
    return None, flag


def _log_level(args: argparse.Namespace) -> str:
    """`--log-level`, else its variable, else info.

    Raises:
        SettingError: not one of `logs.LEVELS`.
    """
    raw, source = flag_or_env(args.log_level, "--log-level", ENV_LOG_LEVEL)
    if raw is None:
        return "info"
    if raw.lower() not in logs.LEVELS:
        raise SettingError(source, raw, f"must be one of {', '.join(logs.LEVELS)}")
    return raw.lower()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `meshagent` and `python -m agent`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        args.log_level = _log_level(args)
        logs.setup(args.log_level)
        return handler(args)
    except AgentError as exc:
        print(f"meshagent: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

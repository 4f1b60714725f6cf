"""`meshagent controlplane`, `certs` and `run`: the mesh's own processes and its PKI.

`controlplane` serves Destination, Identity and policy (or mints a token it
accepts), `certs` creates and inspects the trust anchor and the identity issuer,
`run` is the node agent itself.

Rules, as for every noun module (agent.cli): one `register_<noun>(sub)` per
noun declares its parser and verbs, and its handlers follow it. Parsers and
handlers import their modules lazily, so that a quick command does not pay for
gRPC or bcc. Flags come from the option tables (agent.config,
agent.identity.options, agent.supervisor.settings), so each mirrors a
`MESHAGENT_*` variable.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from agent.cli import add_verbs, emit, output_flag

if TYPE_CHECKING:
    import argparse


# === controlplane ============================================================


def register_controlplane(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def register_certs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent import config  # noqa: PLC0415 - lazy, see module docstring
    from agent.identity import options  # noqa: PLC0415

    verbs = add_verbs(
        sub, "certs", "create and inspect the mesh PKI (trust anchor, identity issuer)"
    )
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
        output_flag(parser)
        parser.set_defaults(handler=handler)
    insp = verbs.add_parser("inspect", help="describe a certificate and whether it chains")
    insp.add_argument("file", metavar="FILE")
    insp.add_argument("--ca", metavar="FILE", help="trust bundle (default: ca.crt next to FILE)")
    output_flag(insp)
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
    emit(summary, args, rows=summary["files"])
    return 0


def _certs_create_issuer(args: argparse.Namespace) -> int:
    from agent import config  # noqa: PLC0415 - lazy, see module docstring
    from agent.identity import ca, options  # noqa: PLC0415

    values = config.resolve(args, os.environ, options.CREATE_ISSUER)
    created = ca.create_issuer(args.dir, args.ca, lifetime=values["lifetime"], force=args.force)
    summary = created.summary()
    emit(summary, args, rows=summary["files"])
    return 0


def _certs_inspect(args: argparse.Namespace) -> int:
    """Exit 1 when a trust bundle was found or given and the certificate does not chain."""
    from agent.identity import ca  # noqa: PLC0415 - lazy, see module docstring

    info = ca.inspect(args.file, ca=args.ca)
    rows = [{"field": key, "value": value} for key, value in info.items()]
    emit(info, args, rows=rows)
    return 1 if info["chains"] is False else 0


# === run ======================================================================


def register_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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

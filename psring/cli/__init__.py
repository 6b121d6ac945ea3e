"""The ``psring`` command line: a flag whose help names a PSRING_* variable defaults to it.

Exit codes: 0 done, 1 a failure while running (a PsringError, a job that failed), 2 bad
arguments or a bad PSRING_* value (named in one line, no traceback).

Commands: store, server, launch (``serve``); train (``train``); bench (``bench``);
worker, submit, status, doctor, dashboard, advise, trace (``cluster``). ``psring --help-env`` lists every
environment variable psring reads (psring.settings).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .. import settings as settings_mod
from ..core import wire
from ..errors import PsringError
from ..topology import stall
from ..version import __version__
from . import bench, cluster, serve, train


class _HelpEnv(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="list the environment variables psring reads, and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(settings_mod.help_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    env = settings_mod.current()
    parser = argparse.ArgumentParser(
        prog="psring", description="Synchronous data-parallel SGD over a ring or a parameter server."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    parser.add_argument("--help-env", action=_HelpEnv)
    parser.add_argument(
        "--version",
        action="version",
        version=f"psring {__version__} (wire {wire.WIRE_VERSION})",
        help="print psring's version and its wire protocol's, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve.register(sub, env)
    bench.register(sub, env)
    train.register(sub, env)
    cluster.register(sub, env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    stall.install_dump_signal()  # every command: kill -USR1 PID prints what it waits in, and it goes on
    try:
        parser = build_parser()
    except ValueError as exc:  # a PSRING_* variable with a bad value
        print(f"psring: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except PsringError as exc:  # a failure while running (ProtocolError, MismatchError are ValueErrors too)
        print(f"psring {args.command}: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as exc:  # what the command was given
        print(f"psring {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

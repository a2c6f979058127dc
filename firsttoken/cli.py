"""`firsttoken serve | diag | replay` — a thin dispatcher, and the parser every command uses.

Exit status 2 is a usage problem (a bad flag or setting), told in one line plus a hint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from firsttoken import __version__

__all__ = ["Parser", "main"]

_USAGE = """usage: firsttoken {serve,diag,replay} [options]

  serve    run the server (synthetic engine by default)
  diag     measure any SSE endpoint: TTFT, chunk intervals, buffering
  replay   replay a captured stream to stdout or as an SSE endpoint

'firsttoken COMMAND --help' lists a command's options; 'firsttoken --version' the version.
"""


class Parser(argparse.ArgumentParser):
    """argparse that answers a bad flag with the error and a hint, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        usage_error(self.prog, message)


def usage_error(prog: str, message: str) -> NoReturn:
    print(f"{prog}: {message}", file=sys.stderr)
    print(f"try '{prog} --help' for the options", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"firsttoken {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        return _serve(rest)
    if command == "diag":
        from firsttoken.tools.diag import main as diag

        return diag(rest)
    if command == "replay":
        from firsttoken.tools.replay import main as replay

        return replay(rest)
    usage_error("firsttoken", f"unknown command {command!r} (serve, diag or replay)")


def _serve(argv: list[str]) -> int:
    from firsttoken.config import SettingError, Settings

    try:
        settings = Settings.from_args(argv)
    except SettingError as exc:
        print(f"firsttoken serve: {exc}", file=sys.stderr)
        return 2
    from firsttoken.server import serve

    serve(settings)
    return 0

"""`firsttoken serve | diag | replay` — a thin dispatcher (the parser every command uses is
`config.Parser`, on the ground floor).

Exit status 2 is a usage problem (a bad flag or setting), told in one line plus a hint.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from firsttoken import __version__
from firsttoken.config import usage_error

__all__ = ["main"]

_USAGE = """usage: firsttoken {serve,diag,replay} [options]

  serve    run the server (synthetic engine by default)
  diag     measure any SSE endpoint: TTFT, chunk intervals, buffering
  replay   replay a captured stream to stdout or as an SSE endpoint
  usage    what the usage ledger holds: tokens and cost by key, route, target or day

'firsttoken COMMAND --help' lists a command's options; 'firsttoken --version' the version.
"""


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
    if command == "usage":
        from firsttoken.ledger.report import main as usage

        return usage(rest)
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

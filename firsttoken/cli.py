"""`firsttoken serve | diag | replay` — a thin dispatcher."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

_USAGE = """usage: firsttoken {serve,diag,replay} [options]

  serve    run the server (synthetic engine by default)
  diag     measure any SSE endpoint: TTFT, chunk intervals, buffering
  replay   replay a captured stream to stdout or as an SSE endpoint

'firsttoken COMMAND --help' lists a command's options.
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from firsttoken.config import Settings
        from firsttoken.server import serve

        serve(Settings.from_args(rest))
        return 0
    if command == "diag":
        from firsttoken.tools.diag import main as diag

        return diag(rest)
    if command == "replay":
        from firsttoken.tools.replay import main as replay

        return replay(rest)
    print(f"firsttoken: unknown command {command!r}\n\n{_USAGE}", end="", file=sys.stderr)
    return 2

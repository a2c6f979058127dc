"""`firsttoken serve | diag | replay | check | keys | usage` — a thin dispatcher (the parser
every command uses is `config.Parser`, on the ground floor).

Exit status 2 is a usage problem (a bad flag or setting), told in one line plus a hint.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from firsttoken.config import usage_error
from firsttoken.version import __version__

__all__ = ["main"]

_USAGE = """usage: firsttoken {serve,diag,replay,check,keys,usage} [options]

  serve    run the server (synthetic engine by default)
  diag     measure any SSE endpoint: TTFT, chunk intervals, buffering
  replay   replay a captured stream to stdout or as an SSE endpoint
  check    validate the keys, routes and canned answers files as a reload would
  keys     'keys new NAME': a fresh key; 'keys rotate NAME': a new secret for a key; 'keys hash'
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
    if command == "check":
        return _check(rest)
    if command == "keys":
        return _keys(rest)
    usage_error(
        "firsttoken", f"unknown command {command!r} (serve, diag, replay, check, keys or usage)"
    )


def _check(argv: list[str]) -> int:
    """The validation a reload runs, offline: one line per problem, exit 0 or 1."""
    import os

    from firsttoken.config import Parser
    from firsttoken.reload import ConfigFiles, check_files, unmatched_routes, unpriced_targets

    parser = Parser(
        prog="firsttoken check",
        description="Validate the files a server reloads (each defaults to its FIRSTTOKEN_* "
        "variable, as serve reads it): exit 0 when all are valid, 1 otherwise.",
    )
    parser.add_argument("--api-keys", metavar="FILE", default=os.environ.get("FIRSTTOKEN_API_KEYS"))
    parser.add_argument("--routes", metavar="FILE", default=os.environ.get("FIRSTTOKEN_ROUTES"))
    parser.add_argument(
        "--canned-answers", metavar="FILE", default=os.environ.get("FIRSTTOKEN_CANNED_ANSWERS")
    )
    args = parser.parse_args(argv)
    files = ConfigFiles(args.api_keys, args.routes, args.canned_answers)
    if not files.paths():
        usage_error("firsttoken check", "no file to check (--api-keys, --routes, --canned-answers)")
    problems = check_files(files)
    for problem in problems:
        print(problem, file=sys.stderr)
    # Not failures: the key is refused that route; the target's tokens cost 0.
    for warning in unmatched_routes(files) + unpriced_targets(files):
        print(f"warning: {warning}", file=sys.stderr)
    bad = {p.split(": ", 1)[0] for p in problems}
    for path in files.paths():
        if path not in bad:
            print(f"{path}: ok")
    return 1 if problems else 0


def _keys(argv: list[str]) -> int:
    """`keys new NAME`: a fresh secret (printed once) and the [[keys]] lines that hold only
    its digest; `keys rotate NAME`: a fresh secret added to NAME in the keys file, with its
    limits; `keys hash`: the digest of the secret on stdin."""
    import json
    import os

    from firsttoken.admission.keys import digest_hex, new_secret, rotate
    from firsttoken.config import Parser

    parser = Parser(
        prog="firsttoken keys",
        description="Make API keys: each secret is printed once; keys files hold its digest.",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="{new,rotate,hash}")
    new = actions.add_parser(
        "new", help="a fresh key: its secret, then the [[keys]] lines to paste (no secret)"
    )
    new.add_argument("name", help="the key's name (logs, metrics, limit errors)")
    turn = actions.add_parser(
        "rotate",
        help="a fresh secret for an existing key, appended to the keys file with its limits",
    )
    turn.add_argument("name", help="the key's name in the keys file")
    turn.add_argument(
        "--api-keys",
        metavar="FILE",
        default=os.environ.get("FIRSTTOKEN_API_KEYS"),
        help="the keys file (default: FIRSTTOKEN_API_KEYS)",
    )
    actions.add_parser("hash", help="the digest (key_sha256) of the secret on stdin")
    args = parser.parse_args(argv)
    if args.action == "new":
        secret = new_secret()
        print(secret)
        print()
        print("[[keys]]")
        print(f"name = {json.dumps(args.name)}")
        print(f'key_sha256 = "{digest_hex(secret)}"')
        print(
            "firsttoken keys: the first line is the new key's secret, shown only now: give it "
            "to its user; paste the [[keys]] lines into the keys file (they hold no secret)",
            file=sys.stderr,
        )
        return 0
    if args.action == "rotate":
        if not args.api_keys:
            usage_error("firsttoken keys rotate", "no keys file (--api-keys FILE)")
        try:
            secret, index = rotate(args.api_keys, args.name)
        except (OSError, ValueError) as exc:
            print(f"firsttoken keys rotate: {exc}", file=sys.stderr)
            return 1
        print(secret)
        print(
            f"firsttoken keys rotate: the line above is a new secret of the key {args.name!r}, "
            f"shown only now; {args.api_keys} holds its digest as keys[{index}], with the "
            "key's limits. Reload (SIGHUP, or --watch-config), give the secret to its owner, "
            "then remove the old entry (or set disabled = true on it) and reload again",
            file=sys.stderr,
        )
        return 0
    secret = sys.stdin.read().strip()
    if not secret:
        print("firsttoken keys hash: no secret on stdin", file=sys.stderr)
        return 1
    print(digest_hex(secret))
    return 0


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

"""The bare ASGI app (`bare_asgi`) under uvicorn + httptools + uvloop, access log off.

    BARE_MODE=stream [BARE_DIRECT=1] python -m bench.servers.bare_uvicorn --port PORT

With `BARE_DIRECT=1` the connection is uvicorn's httptools protocol plus one line that puts
itself in the scope (what firsttoken's `wire/connection.py` does), so a stream can write to the
transport from the shared ticker instead of awaiting ASGI `send` per token.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bench.servers.bare_asgi import CONNECTION_KEY, app

__all__ = ["main"]


class DirectProtocol(HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CONNECTION_KEY] = self  # type: ignore[literal-required]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.servers.bare_uvicorn")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    direct = os.environ.get("BARE_DIRECT") == "1"
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http=DirectProtocol if direct else "httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        backlog=4096,
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()

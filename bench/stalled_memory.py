"""Memory a stalled reader holds: N clients that never read, each on a long answer.

    .venv/bin/python -m bench.stalled_memory [--streams 50]

Prints server RSS growth per stalled stream once generation has paused (backpressure),
next to the bytes of answer each stream would have produced unbounded.
"""

from __future__ import annotations

import argparse
import socket
import time

from tests.servers import run_server, wait_for

BODY = (
    b'{"messages":[{"role":"user","content":"stall"}],"stream":true,'
    b'"synthetic":{"answer_tokens":20000}}'
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=50)
    args = parser.parse_args()
    with run_server(
        "--synthetic-ttft-ms",
        "1",
        "--synthetic-itl-ms",
        "1",
        "--send-timeout-s",
        "600",
        "--rate-limit-per-s",
        "0",
    ) as srv:
        base = wait_for(lambda: srv.metric("firsttoken_memory_rss_bytes"))
        socks = []
        for _ in range(args.streams):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", srv.port))
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
            )
            socks.append(sock)

        def settled() -> float | None:
            before = srv.metric("firsttoken_tokens_generated_total")
            time.sleep(0.5)
            after = srv.metric("firsttoken_tokens_generated_total")
            return after if after == before and after > 0 else None

        generated = wait_for(settled, timeout=60)
        time.sleep(0.5)  # one more memory sample
        rss = srv.metric("firsttoken_memory_rss_bytes")
        per_stream = (rss - base) / args.streams
        print(
            f"{args.streams} stalled streams: generation paused at "
            f"{generated / args.streams:.0f} tokens each (of 20000)"
        )
        print(
            f"RSS growth per stalled stream: {per_stream / 1024:.0f} KiB "
            f"(unbounded it would buffer ~{20000 * 230 / 1024:.0f} KiB of events each)"
        )
        for sock in socks:
            sock.close()


if __name__ == "__main__":
    main()

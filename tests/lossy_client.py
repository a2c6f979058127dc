"""Run inside a lossy namespace (`python -m tests.lossy_client URL STREAMS TOKENS`): streams
checked token by token, and native streams cut halfway and resumed; prints one JSON line."""

from __future__ import annotations

import json
import socket
import sys
import threading
from urllib.parse import urlsplit

import httpx

from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder

TIMEOUT = httpx.Timeout(60.0, connect=30.0)


def chat(url: str, seed: int, tokens: int) -> bool:
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "lossy"}],
        "stream": True,
        "max_tokens": tokens,
        "seed": seed,
    }
    got, done = [], False
    decoder = EventDecoder()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        for chunk in r.iter_raw():
            for event in decoder.feed(chunk):
                if event.data == "[DONE]":
                    done = True
                elif event.event is None and event.data:
                    choices = json.loads(event.data)["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        got.append(choices[0]["delta"]["content"])
    return done and got == synthetic_tokens("user: lossy", seed, tokens)[0]


def native_tokens(body: bytes) -> tuple[list[str], str, bool]:
    decoder = EventDecoder()
    got, done = [], False
    for event in decoder.feed(body):
        if event.data == "[DONE]":
            done = True
        elif event.event is None and event.data:
            got.append(json.loads(event.data)["token"])
    return got, decoder.last_event_id, done


def resume(url: str, seed: int, tokens: int) -> bool:
    """Read about half a native stream on one connection, drop it, resume on another."""
    answer = httpx.post(
        url + "/v1/streams",
        json={"prompt": "resume", "max_tokens": tokens, "seed": seed},
        timeout=TIMEOUT,
    )
    if answer.status_code != 201:
        raise RuntimeError(f"create: {answer.status_code} {answer.text[:300]}")
    created = answer.json()
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    sock.sendall(f"GET {created['events_url']} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    raw = b""
    while raw.count(b'{"token":') < tokens // 2:
        data = sock.recv(65536)
        if not data:
            break
        raw += data
    sock.close()
    body = raw.partition(b"\r\n\r\n")[2]
    # De-chunk: sizes are hex lines; a partial last chunk is cut at the last full event.
    plain, rest = b"", body
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0 or len(rest) < size + 2:
            break
        plain, rest = plain + rest[:size], rest[size + 2 :]
    first, last_id, done_first = native_tokens(plain)
    r = httpx.get(url + created["events_url"], headers={"Last-Event-ID": last_id}, timeout=TIMEOUT)
    rest_tokens, _, done = native_tokens(r.content)
    done = done or done_first  # a read past the half may have taken it all (then: 204)
    expected = synthetic_tokens("resume", seed, tokens)[0]
    if not done or first + rest_tokens != expected:
        raise RuntimeError(
            f"resume from {last_id}: {len(first)}+{len(rest_tokens)} tokens of {len(expected)}, "
            f"done={done}, status={r.status_code}, tail={r.content[-200:]!r}"
        )
    return True


def main() -> None:
    url, streams, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    results: dict[str, list[bool]] = {"exact": [], "resumed": []}
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            results["exact"].append(chat(url, i, tokens))
            results["resumed"].append(resume(url, i, tokens))
        except Exception as exc:  # report it, don't hide it
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(
        json.dumps(
            {
                "streams": sum(results["exact"]),
                "resumed": sum(results["resumed"]),
                "failed": results["exact"].count(False) + results["resumed"].count(False),
                "errors": errors,
            }
        )
    )


if __name__ == "__main__":
    main()

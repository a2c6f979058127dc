"""The relay's upstream client against a real loopback asyncio server started in each test:
body framings, keep-alive reuse, a cut mid-body, timeouts, a hostile head, flow control.

Each test runs on the standard asyncio loop and on uvloop (the gateway's)."""

from __future__ import annotations

import asyncio
import gzip
import shutil
import ssl
import subprocess
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import uvloop

from firsttoken.engines.upstream import (
    HIGH_WATER,
    MAX_HEAD_BYTES,
    ConnectError,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    StreamClosed,
    UpstreamPool,
    UpstreamResponse,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Upstream"], Awaitable[None]]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Awaitable[None]], None]:
    return asyncio.run if request.param == "asyncio" else uvloop.run  # type: ignore[return-value]


@dataclass
class Upstream:
    """A loopback server: `handler` answers each connection; what it saw is recorded."""

    handler: Handler
    url: str = ""
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)  # each request's head + body
    first_reads: list[bytes] = field(default_factory=list)  # each connection's first read
    closed_by_client: int = 0  # connections where the client's EOF was seen
    server: asyncio.Server | None = None

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request (head + Content-Length body); b"" when the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return b""
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body

    async def wait_client_eof(self, reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
        self.closed_by_client += 1


def pool(**kw: float) -> UpstreamPool:
    return UpstreamPool(
        connect_timeout=kw.get("connect_timeout", 5.0), read_timeout=kw.get("read_timeout", 5.0)
    )


async def body_of(resp: UpstreamResponse) -> bytes:
    return b"".join([chunk async for chunk in resp.aiter_raw()])


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


# -- bodies ------------------------------------------------------------------------------------


def test_chunked_body_streams_as_it_comes(run: Callable[[Awaitable[None]], None]) -> None:
    parts = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        w.write(SSE_HEAD)
        for p in parts:
            w.write(b"%x\r\n%s\r\n" % (len(p), p))
            await w.drain()
            await asyncio.sleep(0.02)
        w.write(b"0\r\n\r\n")
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            resp = await client.request("POST", up.url + "/v1/chat", b'{"a":1}', {"x-id": "7"})
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "text/event-stream"
            got = [chunk async for chunk in resp.aiter_raw()]
            assert b"".join(got) == b"".join(parts)
            assert len(got) >= 2  # delivered as it came, not at the end
            # One write: request line, headers and body in the server's first read.
            req = up.requests[0]
            assert req.startswith(b"POST /v1/chat HTTP/1.1\r\n")
            assert b"\r\nx-id: 7\r\n" in req and b"\r\ncontent-length: 7\r\n" in req
            await client.aclose()

    run(body())


def test_request_goes_out_in_one_segment(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        up.first_reads.append(await r.read(65536))
        w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            payload = b'{"messages": "' + b"x" * 4000 + b'"}'
            resp = await client.request("POST", up.url + "/v1/x", payload)
            assert resp.status_code == 204 and await body_of(resp) == b""
            first = up.first_reads[0]
            assert first.startswith(b"POST /v1/x HTTP/1.1\r\n") and first.endswith(payload)
            await client.aclose()

    run(body())


def test_content_length_body_and_keep_alive_reuse(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        while await up.read_request(r):
            n = len(up.requests)
            answer = b'{"n": %d}' % n
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(answer))
            await w.drain()
            w.write(answer)  # the body in a later segment than the head

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            for n in (1, 2, 3):
                resp = await client.request("POST", up.url + "/v1/x", b"{}")
                assert await body_of(resp) == b'{"n": %d}' % n
                resp.close()  # after the end: the connection stays pooled
            assert up.connections == 1  # all three on one keep-alive connection
            await client.aclose()

    run(body())


def test_close_delimited_body(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        w.write(b"data: a\n\n")
        await w.drain()
        await asyncio.sleep(0.02)
        w.write(b"data: b\n\n")
        await w.drain()

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            assert await body_of(resp) == b"data: a\n\ndata: b\n\n"  # ends with the connection
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            assert await body_of(resp) == b"data: a\n\ndata: b\n\n"
            assert up.connections == 2  # a close-delimited connection is not reused
            await client.aclose()

    run(body())


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    ("encoding", "pack"),
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", _raw_deflate)],
)
def test_a_compressed_body_is_decoded_by_aiter_bytes(
    run: Callable[[Awaitable[None]], None], encoding: str, pack: Callable[[bytes], bytes]
) -> None:
    payload = b'{"error": {"message": "' + b"overloaded " * 200 + b'"}}'

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        packed = pack(payload)
        w.write(
            b"HTTP/1.1 503 X\r\ncontent-encoding: %s\r\ncontent-length: %d\r\n\r\n"
            % (encoding.encode(), len(packed))
        )
        w.write(packed[:10])  # the first bytes alone, then the rest
        await w.drain()
        await asyncio.sleep(0.01)
        w.write(packed[10:])
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            assert resp.status_code == 503
            assert b"".join([c async for c in resp.aiter_bytes()]) == payload
            await client.aclose()

    run(body())


# -- breaks ------------------------------------------------------------------------------------


def test_take_and_wait_read_the_body_without_an_iterator(
    run: Callable[[Awaitable[None]], None],
) -> None:
    parts = [b"data: one\n\n", b"data: two\n\n"]
    frames = [b"%x\r\n%s\r\n" % (len(p), p) for p in parts]

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        for data in (SSE_HEAD + frames[0], frames[1], b"0\r\n\r\n"):
            w.write(data)
            await w.drain()
            await asyncio.sleep(0.02)
        await up.read_request(r)  # kept alive: a second request, cut after its first chunk
        w.write(SSE_HEAD + frames[0])
        await w.drain()
        await asyncio.sleep(0.02)
        w.transport.abort()

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            got: list[bytes] = []
            while not resp.ended:
                data = resp.take()
                if data:
                    got.append(data)
                else:
                    await resp.wait()
            assert b"".join(got) == b"".join(parts) and resp.take() == b""
            resp.close()
            # The connection went back to the pool: the next request reuses it.
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            assert up.connections == 1
            await resp.wait()
            assert resp.take() == parts[0]
            await resp.wait()
            with pytest.raises(ReadError):
                resp.take()  # a cut: raised once nothing is left before it
            assert not resp.ended
            resp.close()
            await client.aclose()

    run(body())


def test_a_cut_mid_body_is_a_read_error(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        if len(up.requests) == 1:  # chunked, cut between chunks
            w.write(SSE_HEAD + b"b\r\ndata: one\n\n\r\n")
        else:  # content-length, cut short
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await w.drain()
        await asyncio.sleep(0.02)
        w.transport.abort()

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            for expected in (b"data: one\n\n", b"only this"):
                resp = await client.request("POST", up.url + "/v1/x", b"{}")
                got = b""
                with pytest.raises(ReadError):
                    async for chunk in resp.aiter_raw():
                        got += chunk
                assert got == expected
                resp.close()
            await client.aclose()

    run(body())


def test_connect_refused_is_a_connect_error(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = pool()
        with pytest.raises(ConnectError):
            await client.request("POST", f"http://127.0.0.1:{port}/v1/x", b"{}")
        await client.aclose()

    run(body())


def test_a_slow_head_is_a_read_timeout_and_closes(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\n")  # part of a head, then nothing
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool(read_timeout=0.2)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(ReadTimeout):
                await client.request("POST", up.url + "/v1/x", b"{}")
            assert 0.15 < loop.time() - t0 < 2.0
            for _ in range(100):  # the server sees the connection close
                if up.closed_by_client:
                    break
                await asyncio.sleep(0.01)
            assert up.closed_by_client == 1
            await client.aclose()

    run(body())


def test_a_stall_mid_body_is_a_read_timeout(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        w.write(SSE_HEAD)
        for _ in range(3):  # bytes every 0.1 s keep a 0.25 s read timeout from firing
            w.write(b"b\r\ndata: one\n\n\r\n")
            await w.drain()
            await asyncio.sleep(0.1)
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool(read_timeout=0.25)
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            got = b""
            with pytest.raises(ReadTimeout):
                async for chunk in resp.aiter_raw():
                    got += chunk
            assert got == b"data: one\n\n" * 3
            await client.aclose()

    run(body())


@pytest.mark.parametrize("shape", ["many headers", "one endless header"])
def test_an_oversized_head_is_refused(run: Callable[[Awaitable[None]], None], shape: str) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\n")
        if shape == "many headers":
            for i in range(2000):
                w.write(b"x-filler-%d: %s\r\n" % (i, b"y" * 60))
            w.write(b"\r\n")
            await w.drain()
        else:  # a header value that never ends, a megabyte at a time
            w.write(b"x-endless: ")
            try:
                for _ in range(64):
                    w.write(b"z" * (1 << 20))
                    await w.drain()
            except ConnectionError:  # the client closed with bytes unread: a reset
                up.closed_by_client += 1
                return
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            with pytest.raises(RemoteProtocolError, match=str(MAX_HEAD_BYTES)):
                await client.request("POST", up.url + "/v1/x", b"{}")
            for _ in range(200):
                if up.closed_by_client:
                    break
                await asyncio.sleep(0.01)
            assert up.closed_by_client == 1  # closed, not read to the end
            await client.aclose()

    run(body())


def test_garbage_is_a_protocol_error(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        w.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            with pytest.raises(RemoteProtocolError):
                await client.request("POST", up.url + "/v1/x", b"{}")
            await client.aclose()

    run(body())


# -- closing, flow control, stale connections --------------------------------------------------


def test_close_before_the_end_closes_the_connection(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        if not await up.read_request(r):
            return
        w.write(SSE_HEAD + b"b\r\ndata: one\n\n\r\n")  # then it would go on for long
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            chunks = resp.aiter_raw()
            assert await anext(chunks) == b"data: one\n\n"
            resp.close()
            with pytest.raises(StreamClosed):
                await anext(chunks)
            for _ in range(100):
                if up.closed_by_client:
                    break
                await asyncio.sleep(0.01)
            assert up.closed_by_client == 1  # the upstream saw the close at once
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            assert up.connections == 2  # the cut connection was not reused
            resp.close()
            await client.aclose()

    run(body())


def test_a_slow_reader_pauses_the_upstream(run: Callable[[Awaitable[None]], None]) -> None:
    total = 8 * 1024 * 1024
    piece = b"x" * 65536

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // len(piece)):
            w.write(piece)
            await w.drain()
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            await asyncio.sleep(0.3)  # not reading: the client must stop reading too
            held = resp._buffered
            assert held <= HIGH_WATER + 1024 * 1024, held  # bounded (one read past the mark)
            assert len(await body_of(resp)) == total  # and then everything arrives
            await client.aclose()

    run(body())


def test_a_connection_closed_while_idle_is_not_used(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        await up.read_request(r)
        if up.connections == 1:
            # Keep-alive answered, then the next request is met with a close (an idle
            # timeout racing the request): the client retries once on a fresh connection.
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()
            await up.read_request(r)
            return
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfresh")
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            assert await body_of(resp) == b"ok"
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            assert await body_of(resp) == b"fresh"
            assert up.connections == 2 and len(up.requests) == 3
            await client.aclose()

    run(body())


async def until(ok: Callable[[], bool]) -> None:
    for _ in range(200):
        if ok():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 2 s")


def test_a_warm_origin_has_a_connection_open_before_its_first_request(
    run: Callable[[Awaitable[None]], None],
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        while await up.read_request(r):
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            client.warm(up.url + "/v1", 1)
            await until(lambda: up.connections == 1)
            assert not up.requests  # open, nothing asked yet
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            assert await body_of(resp) == b"ok"
            # The request took the warm one; its successor is opened meanwhile.
            await until(lambda: up.connections == 2)
            resp = await client.request("POST", up.url + "/v1/x", b"{}")
            assert await body_of(resp) == b"ok"
            await asyncio.sleep(0.05)
            assert up.connections == 2  # one spare kept: the used one came back idle
            await client.aclose()

    run(body())


def test_a_warm_connection_the_upstream_closes_idle_is_replaced_once(
    run: Callable[[Awaitable[None]], None],
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        if up.connections <= 3:
            return  # closed at once, idle: as an upstream's keep-alive timeout does
        await up.wait_client_eof(r)

    async def body() -> None:
        async with Upstream(handler) as up:
            client = pool()
            client.warm(up.url, 1)
            await asyncio.sleep(0.3)
            # The first close is followed by one successor; that one's close, within
            # REFILL_MIN_S, is not: no connect loop with an upstream that closes at once.
            assert up.connections == 2
            await client.aclose()

    run(body())


def test_a_warm_origin_that_is_down_costs_no_error(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        client = pool(connect_timeout=0.5)
        client.warm("http://127.0.0.1:9/v1", 1)  # the discard port: refused
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectError):
            await client.request("POST", "http://127.0.0.1:9/v1/x", b"{}")
        await client.aclose()

    run(body())


def test_a_header_with_a_line_break_is_refused(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        client = pool()
        with pytest.raises(ValueError, match="CR, LF or NUL"):
            await client.request("POST", "http://127.0.0.1:9/v1/x", b"{}", {"x-id": "a\r\nevil: 1"})
        await client.aclose()

    run(body())


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (the openssl command line; skip without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    args = "req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1"
    args += " -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1"
    subprocess.run(
        ["openssl", *args.split(), "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_https_upstream(run: Callable[[Awaitable[None]], None], tls_files: tuple[str, str]) -> None:
    cert, key = tls_files

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: Upstream) -> None:
        while await up.read_request(r):
            w.write(SSE_HEAD + chunked(b"data: secret\n\n"))
            await w.drain()

    async def body() -> None:
        server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_side.load_cert_chain(cert, key)
        up = Upstream(handler)
        up.server = await asyncio.start_server(up._serve, "127.0.0.1", 0, ssl=server_side)
        port = up.server.sockets[0].getsockname()[1]
        trusting = ssl.create_default_context(cafile=cert)
        client = UpstreamPool(connect_timeout=5, read_timeout=5, ssl_context=trusting)
        for _ in range(2):
            resp = await client.request("POST", f"https://127.0.0.1:{port}/v1/x", b"{}")
            assert await body_of(resp) == b"data: secret\n\n"
        assert up.connections == 1  # kept alive over TLS too
        await client.aclose()
        # A client that does not trust the certificate does not connect.
        with pytest.raises(ConnectError):
            await pool().request("POST", f"https://127.0.0.1:{port}/v1/x", b"{}")
        up.server.close()

    run(body())

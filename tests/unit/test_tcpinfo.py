"""`diag --packet-loss` arithmetic on made-up samples, and TCP_INFO of a real socket."""

from __future__ import annotations

import socket

import pytest

from firsttoken.tools._tcpinfo import TcpInfo, TcpWatch, _Connection, read_tcp_info


def test_gaps_that_saw_a_repair_explain_the_tail() -> None:
    conn = _Connection(start=TcpInfo(rtt_us=100))
    t, ooo = 0.0, 0
    for i in range(200):
        lost = i % 50 == 25  # 4 losses, each a 40 ms gap instead of 10 ms
        t += 0.040 if lost else 0.010
        ooo += lost
        conn.samples.append((t, 100, TcpInfo(rtt_us=200, rttvar_us=50, rcv_ooopack=ooo)))
    conn.content.append([0, 199])
    watch = TcpWatch()
    watch.connections.append(conn)
    tcp = watch.summary()
    assert tcp is not None
    assert (tcp["retransmits"], tcp["lost"], tcp["retransmit_gaps"]) == (4, 4, 4)
    assert (tcp["rtt_ms"], tcp["rtt_var_ms"]) == (0.2, 0.05)
    assert tcp["itl_p99_ms"] > 30 and tcp["itl_p99_without_retransmit_gaps_ms"] < 11
    assert tcp["tail_cause"] == "retransmissions" and tcp["tail_explained"] > 0.6


def test_a_clean_stream_names_no_cause_of_its_own() -> None:
    conn = _Connection(start=TcpInfo())
    conn.samples = [(i * 0.01 + (0.03 if i == 50 else 0), 10, TcpInfo()) for i in range(100)]
    conn.content.append([0, 99])
    watch = TcpWatch()
    watch.connections.append(conn)
    tcp = watch.summary()
    assert tcp is not None and tcp["retransmits"] == 0
    assert tcp["tail_cause"] == "not retransmissions" and tcp["tail_explained"] == 0
    assert TcpWatch().summary() is None  # nothing watched: null, not zeros


def test_only_reads_that_carried_content_make_gaps() -> None:
    """The wait for the first token and the time between two responses on one connection are
    not inter-chunk gaps (they made a p99 of 164 ms out of 20 ms gaps, issue 26)."""
    conn = _Connection(start=TcpInfo())
    t = 0.0
    for _response in range(2):
        t += 0.5  # the next request: its head, alone in a read
        conn.samples.append((t, 200, TcpInfo()))
        t += 0.2  # its time to first token
        conn.samples.append((t, 30, TcpInfo()))
        conn.note_content(first=True)
        for _ in range(9):
            t += 0.02
            conn.samples.append((t, 30, TcpInfo()))
            conn.note_content(first=False)
        conn.samples.append((t + 0.001, 0, TcpInfo()))  # the end of the body: no data
    assert conn.content == [[1, 10], [13, 22]]
    watch = TcpWatch()
    watch.connections.append(conn)
    tcp = watch.summary()
    assert tcp is not None and tcp["gaps"] == 18
    assert tcp["itl_p99_ms"] == pytest.approx(20, abs=0.01)


def test_reads_a_real_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        with client, peer:
            peer.sendall(b"x" * 1000)
            assert client.recv(2000)
            info = read_tcp_info(client)
    assert info is not None and info.total_retrans == 0 and info.rtt_us > 0

"""`diag --packet-loss` arithmetic on made-up samples, and TCP_INFO of a real socket."""

from __future__ import annotations

import socket

from firsttoken.tools._tcpinfo import TcpInfo, TcpWatch, _Connection, read_tcp_info


def test_gaps_that_saw_a_repair_explain_the_tail() -> None:
    conn = _Connection(start=TcpInfo(rtt_us=100))
    t, ooo = 0.0, 0
    for i in range(200):
        lost = i % 50 == 25  # 4 losses, each a 40 ms gap instead of 10 ms
        t += 0.040 if lost else 0.010
        ooo += lost
        conn.samples.append((t, 100, TcpInfo(rtt_us=200, rttvar_us=50, rcv_ooopack=ooo)))
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
    watch = TcpWatch()
    watch.connections.append(conn)
    tcp = watch.summary()
    assert tcp is not None and tcp["retransmits"] == 0
    assert tcp["tail_cause"] == "not retransmissions" and tcp["tail_explained"] == 0
    assert TcpWatch().summary() is None  # nothing watched: null, not zeros


def test_reads_a_real_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        with client, peer:
            peer.sendall(b"x" * 1000)
            assert client.recv(2000)
            info = read_tcp_info(client)
    assert info is not None and info.total_retrans == 0 and info.rtt_us > 0

"""The coalescer's rules, property-tested on a fake clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from firsttoken.core.chunking import Chunk, CoalescePolicy, Coalescer

tokens = st.lists(
    st.one_of(
        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8),
        st.sampled_from([" word", ".", ",", "\n\n", " 한국", "어", "。", "🚀", " x" * 400]),
    ),
    min_size=1,
    max_size=60,
)
gaps = st.lists(st.floats(min_value=0, max_value=0.2), min_size=60, max_size=60)


def run(
    toks: list[str], arrivals: list[float], policy: CoalescePolicy
) -> list[tuple[Chunk, float, list[float]]]:
    """Drive the coalescer like the producer does: a token arrives, or a deadline passes
    first. Returns each chunk with its emit time and its tokens' arrival times."""
    c = Coalescer(policy)
    out: list[tuple[Chunk, float, list[float]]] = []
    pending: list[float] = []

    def emit(chunks: list[Chunk], now: float) -> None:
        for chunk in chunks:
            n = max(chunk.tokens, 0)
            out.append((chunk, now, pending[:n] if n else pending[:1]))
            del pending[:n]

    for text, at in zip(toks, arrivals, strict=False):
        deadline = c.deadline
        if deadline is not None and deadline <= at:
            emit(c.due(deadline), deadline)
        pending.append(at)
        emit(c.push(text, at), at)
    end = arrivals[len(toks) - 1]
    deadline = c.deadline
    if deadline is not None:
        emit(c.due(max(deadline, end)), max(deadline, end))
    return out


@settings(max_examples=300, deadline=None)
@given(toks=tokens, gap=gaps, max_bytes=st.integers(4, 64), wait_ms=st.integers(1, 100))
def test_coalescer_rules(toks: list[str], gap: list[float], max_bytes: int, wait_ms: int) -> None:
    policy = CoalescePolicy(max_wait_s=wait_ms / 1000, max_bytes=max_bytes)
    arrivals = []
    t = 0.0
    for g in gap[: len(toks)]:
        t += g
        arrivals.append(t)
    out = run(toks, arrivals, policy)
    chunks = [c for c, _, _ in out]
    # Nothing lost, nothing reordered, token count exact.
    assert "".join(c.text for c in chunks) == "".join(toks)
    assert sum(c.tokens for c in chunks) == len(toks)
    for chunk, emitted, arrived in out:
        # Never over max_bytes, and valid UTF-8 (a str that encodes is whole characters).
        assert len(chunk.text.encode("utf-8")) <= max_bytes
        # No token held longer than max_wait (the fake clock has no scheduling slack).
        assert all(emitted - a <= policy.max_wait_s + 1e-9 for a in arrived)
    # The first token is never delayed.
    assert out[0][1] == arrivals[0]


def test_boundaries_flush_and_words_merge() -> None:
    c = Coalescer(CoalescePolicy(max_wait_s=1.0, max_bytes=1024))
    assert c.push("Hello", 0.0) == [Chunk("Hello", 1)]
    assert c.push(" there", 0.01) == []
    assert c.push(" friend", 0.02) == []
    assert c.push(".", 0.03) == [Chunk(" there friend.", 3)]
    assert c.push(" 流式", 0.04) == []
    assert c.push("传输。", 0.05) == [Chunk(" 流式传输。", 2)]
    assert c.push(" tail", 0.06) == []
    assert c.due(0.5) == []
    assert c.due(1.06) == [Chunk(" tail", 1)]


def test_long_token_split_on_characters() -> None:
    c = Coalescer(CoalescePolicy(max_wait_s=1.0, max_bytes=4))
    out = c.push("가나다", 0.0)  # 9 bytes: 3 bytes a character
    assert [x.text for x in out] == ["가", "나", "다"]
    assert sum(x.tokens for x in out) == 1

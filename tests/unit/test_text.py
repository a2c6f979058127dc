from __future__ import annotations

import random
import time
from collections.abc import Iterator

from firsttoken.engines.synthetic import synthetic_tokens
from firsttoken.engines.text import EXACT_CHARS, StopCut, apply_stop, count_words, split_words


def test_the_answer_is_cut_before_the_first_stop_string() -> None:
    tokens = [" Hello", " wor", "ld", ". More", " text"]
    cut, stopped = apply_stop(tokens, ("ld.", "xyz"))
    assert stopped and "".join(cut) == " Hello wor"
    assert cut == [" Hello", " wor"]


def test_a_stop_inside_a_token_keeps_its_prefix() -> None:
    cut, stopped = apply_stop([" alpha", " beta gamma"], (" gamma",))
    assert stopped and cut == [" alpha", " beta"]


def test_no_stop_string_leaves_the_answer_whole() -> None:
    tokens, _ = synthetic_tokens("hi", 1, 30)
    assert apply_stop(tokens, ()) == (tokens, False)
    assert apply_stop(tokens, ("\x00never",)) == (tokens, False)


def test_synthetic_answers_are_a_pure_function_of_the_request() -> None:
    assert synthetic_tokens("same", 3, 40) == synthetic_tokens("same", 3, 40)
    assert synthetic_tokens("same", 3, 40) != synthetic_tokens("same", 4, 40)
    tokens, finish = synthetic_tokens("same", 3, 5)
    assert len(tokens) == 5 and finish == "length"


def test_split_words_joins_back() -> None:
    text = "Streaming  is fast,\nand honest. 스트리밍"
    pieces = split_words(text)
    assert "".join(pieces) == text
    assert pieces[0] == "Streaming" and pieces[1] == "  is"


def test_count_words_counts_punctuation() -> None:
    assert count_words("Hello, world!") == 4
    assert count_words("") == 0


def reference_stop(tokens: list[str], stop: tuple[str, ...]) -> tuple[list[str], bool]:
    """apply_stop as it was, over the whole text at once: what the lazy cut must match."""
    text = "".join(tokens)
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if not hits:
        return tokens, False
    end, out, pos = min(hits), [], 0
    for token in tokens:
        if pos + len(token) <= end:
            out.append(token)
            pos += len(token)
            continue
        if end > pos:
            out.append(token[: end - pos])
        break
    return out, True


def test_the_lazy_cut_is_the_whole_text_cut() -> None:
    rng = random.Random(7)
    alphabet = "ab c."
    for _ in range(3000):
        tokens = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(12)]
        stop = tuple(
            "".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 4))
        )
        cut = StopCut(iter(tokens), stop)
        assert (list(cut), cut.stopped) == reference_stop(tokens, stop), (tokens, stop)


def test_the_lazy_cut_reads_only_as_far_as_it_must() -> None:
    read: list[str] = []

    def tokens() -> Iterator[str]:
        for i in range(1_000_000):
            read.append(str(i))
            yield f" w{i}"

    cut = StopCut(tokens(), (" w5 w6", " w9"))
    assert list(cut) == [" w0", " w1", " w2", " w3", " w4"] and cut.stopped
    assert len(read) < 12  # the first stop, and the longest stop's length after it


def test_a_large_text_is_counted_from_samples_in_bounded_time() -> None:
    # Issue 37.5: an 878 KiB prompt of 450k words took ~70 ms to count, on the event loop.
    words = "lorem ipsum, dolor sit amet. " * 40_000
    estimate = count_words(words)
    assert abs(estimate - 7 * 40_000) / (7 * 40_000) < 0.01
    assert len("Hello, world! " * 2000) <= EXACT_CHARS
    assert count_words("Hello, world! " * 2000) == 8000  # short texts: exact
    huge = "a " * 25_000_000  # 50 MB: counting all of it takes seconds
    started = time.process_time()
    assert count_words(huge) == 25_000_000
    assert time.process_time() - started < 0.5

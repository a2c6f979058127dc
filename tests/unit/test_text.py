from __future__ import annotations

from firsttoken.engines.synthetic import synthetic_tokens
from firsttoken.engines.text import apply_stop, count_words, split_words


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

"""gateway/detok.py: streamed text never splits a character and never shows a stop string."""

from __future__ import annotations

import pytest

from gateway.detok import IncrementalDetokenizer, StopMatcher, TextAssembler

TEXT = "Hello café, 5 € world"


def test_multibyte_characters_wait_for_all_their_bytes(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 2  # é and € really are split over byte tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"))
    pieces = [detok.feed([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_any_chunking_gives_the_same_text(tokenizer, chunk: int) -> None:
    ids = tokenizer.encode(TEXT)
    asm = TextAssembler(tokenizer, [])
    out = [asm.feed(ids[i : i + chunk], i + chunk >= len(ids))[0] for i in range(0, len(ids), chunk)]
    assert "".join(out) == TEXT == asm.text


def test_incomplete_tail_is_flushed_at_the_end(tokenizer) -> None:
    ids = tokenizer.encode("a€")[:-1]  # the euro sign's last byte never comes
    asm = TextAssembler(tokenizer, [])
    assert asm.feed(ids, finished=False) == ("a", False)
    text, _ = asm.feed([], finished=True)
    assert text == "\ufffd"


def test_stop_string_is_cut_and_never_emitted_across_chunks() -> None:
    stops = StopMatcher(("STOP", "xyz"))
    assert stops.feed("abc ST") == ("abc ", False)  # "ST" could start "STOP": held back
    assert stops.feed("O") == ("", False)
    assert stops.feed("P and more") == ("", True)


def test_false_start_of_a_stop_string_is_released() -> None:
    stops = StopMatcher(("STOP",))
    assert stops.feed("ST") == ("", False)
    assert stops.feed("ART") == ("START", False)
    assert stops.feed("x S", final=True) == ("x S", False)


def test_earliest_of_several_stop_strings_wins() -> None:
    assert StopMatcher(("world", "lo")).feed("hello world") == ("hel", True)

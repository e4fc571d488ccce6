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


def test_include_stop_keeps_the_matched_stop_string() -> None:
    stops = StopMatcher(("STOP", "ST"), include_stop=True)
    assert stops.feed("abc S") == ("abc ", False)
    assert stops.feed("TOP and more") == ("STOP", True)  # of two stops at one place, the longer
    assert StopMatcher(("lo", "world"), include_stop=True).feed("hello world") == ("hello", True)


def test_no_stop_string_completes_before_min_tokens(tokenizer) -> None:
    ids = tokenizer.encode("xbxbxb")
    assert len(ids) == 6  # a token a character: the stop string "b" completes at tokens 2, 4 and 6
    for chunk in (1, 2, 4, 6):
        for min_tokens, want in ((0, "x"), (2, "x"), (3, "xbx"), (6, "xbxbx"), (7, "xbxbxb")):
            asm = TextAssembler(tokenizer, [], ("b",), min_tokens=min_tokens)
            out, stopped = "", False
            for i in range(0, 6, chunk):
                piece, stopped = asm.feed(ids[i : i + chunk], finished=i + chunk >= 6)
                out += piece
                if stopped:
                    break
            assert (out, stopped) == (want, want != "xbxbxb"), (chunk, min_tokens)


def test_a_stop_string_begun_before_min_tokens_still_matches_after(tokenizer) -> None:
    ids = tokenizer.encode("xSTOPy")
    asm = TextAssembler(tokenizer, [], ("STOP",), min_tokens=3)  # "x", "S", "T": no match can end there
    out = asm.feed(ids[:3], finished=False)
    assert out == ("x", False)  # "ST" held: it may begin the stop string
    assert asm.feed(ids[3:], finished=True) == ("", True)


def test_special_tokens_are_kept_when_asked(tokenizer) -> None:
    ids = tokenizer.encode("hi") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert TextAssembler(tokenizer, []).feed(ids, finished=True) == ("hi", False)
    assert TextAssembler(tokenizer, [], skip_special_tokens=False).feed(ids, finished=True) == ("hi<|im_end|>", False)

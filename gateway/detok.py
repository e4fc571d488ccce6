"""Token ids -> text deltas for streaming: never split a character, never leak a stop string.

Pure Python over a Hugging Face tokenizer; runs on the event loop, one ``TextAssembler`` per request.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"  # what a decoder returns for an incomplete UTF-8 sequence
PROMPT_CONTEXT = 4  # prompt tokens decoded ahead of the output, so a leading space is not lost


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Decodes a window ``ids[prefix:]`` and emits what it adds to ``ids[prefix:read]``.

    Decoding a window instead of each token alone keeps tokenizers whose pieces depend on their
    neighbours (SentencePiece's leading space) exact; holding text that ends in U+FFFD waits for the
    rest of a multi-byte character that a byte-level tokenizer split across tokens.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, end: int) -> str:
        return self._tok.decode(self._ids[self._prefix : end], skip_special_tokens=True)

    def feed(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now stable (possibly empty).

        A speculative step adds several tokens; when only the last ones end in a partial character,
        the text of the tokens before them still goes out now.
        """
        self._ids += token_ids
        before = self._decode(self._read)
        for end in range(len(self._ids), self._read, -1):
            after = self._decode(end)
            if len(after) > len(before) and not after.endswith(REPLACEMENT):
                self._prefix, self._read = self._read, end
                return after[len(before) :]
        return ""

    @property
    def held(self) -> int:
        """Characters decoded but held back (an incomplete character shows as U+FFFD)."""
        return max(len(self._decode(len(self._ids))) - len(self._decode(self._read)), 0)

    def flush(self) -> str:
        """The request ended: whatever is held back, incomplete characters included."""
        before, after = self._decode(self._read), self._decode(len(self._ids))
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""


class StopMatcher:
    """Cuts the text before the first stop string and holds back any tail that could start one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""  # text not yet emitted: at most the longest stop string minus one, plus a delta

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string matched). After a match, stop feeding."""
        pending = self._pending + text
        hits = [i for i in (pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            return pending[: min(hits)], True
        keep = 0 if final else self._partial_len(pending)
        self._pending = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False

    @property
    def pending(self) -> int:
        """Characters held back."""
        return len(self._pending)

    def _partial_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

        Emitted text never ends in such a prefix, so a match can only start inside ``_pending``.
        """
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


class TextAssembler:
    """One request's text: ``feed`` engine tokens, get text to send and whether a stop string ended it."""

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stops: tuple[str, ...] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopMatcher(stops)
        self.text = ""  # everything emitted so far

    @property
    def offset(self) -> int:
        """Characters of output text decoded so far: emitted, or held back by the stop matcher or the detokenizer
        (an incomplete character counted as its U+FFFD). Decodes the held tokens: for logprobs' text offsets."""
        return len(self.text) + self._stops.pending + self._detok.held

    def feed(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        text = self._detok.feed(token_ids)
        if finished:
            text += self._detok.flush()
        out, stopped = self._stops.feed(text, final=finished)
        self.text += out
        return out, stopped


def _byte_alphabet() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``): printable Latin-1 bytes stand
    for themselves, and the other 68 bytes, in order, for code points 256, 257, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    table.update((chr(256 + i), b) for i, b in enumerate(shifted))
    return table


BYTE_ALPHABET = _byte_alphabet()


class TokenText:
    """Each token's own text and bytes, for logprobs (cached: a request reports few distinct tokens).

    The text is the token decoded alone, special tokens included. The bytes are exact for byte-level BPE
    tokenizers (GPT-2, Llama 3, SmolLM): a token holding part of a multi-byte character decodes to U+FFFD,
    and OpenAI's ``bytes`` field is there so a client can join such tokens back into the character.
    Elsewhere they are the text's UTF-8."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        pieces = getattr(tokenizer, "convert_ids_to_tokens", None)
        self._pieces = pieces if pieces is not None and _is_byte_level(tokenizer) else None

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            raw = list(text.encode())
            if self._pieces is not None:
                piece = self._pieces(token_id)
                if isinstance(piece, str) and piece and all(c in BYTE_ALPHABET for c in piece):
                    raw = [BYTE_ALPHABET[c] for c in piece]
            hit = self._cache[token_id] = (text, raw)
        return hit


def _is_byte_level(tokenizer: Decoder) -> bool:
    """A Hugging Face fast tokenizer whose decoder is byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"

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

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._skip_special = skip_special_tokens

    def _decode(self, end: int) -> str:
        return self._tok.decode(self._ids[self._prefix : end], skip_special_tokens=self._skip_special)

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

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop  # vLLM's include_stop_str_in_output: the matched stop string is emitted too
        self._pending = ""  # text not yet emitted: at most the longest stop string minus one, plus a delta

    def feed(self, text: str, final: bool = False, armed: bool = True) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string matched). After a match, stop feeding.
        ``armed=False``: the text may not end the output (before min_tokens); a tail that could start a stop
        string is still held, so a stop string that begins here and ends in armed text matches."""
        pending = self._pending + text
        hits = [(i, -len(s)) for s in self._stops if armed and (i := pending.find(s)) >= 0]
        if hits:
            at, minus_len = min(hits)  # the first match; of two at one place, the longer
            self._pending = ""
            return pending[: at - minus_len if self._include else at], True
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

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stops: tuple[str, ...] = (),
                 include_stop: bool = False, min_tokens: int = 0, skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stops = StopMatcher(stops, include_stop)
        # vLLM checks stop strings once the output holds min_tokens tokens: the tokens before the min_tokens-th
        # cannot complete one
        self._unarmed = max(min_tokens - 1, 0)
        self.text = ""  # everything emitted so far

    @property
    def offset(self) -> int:
        """Characters of output text decoded so far: emitted, or held back by the stop matcher or the detokenizer
        (an incomplete character counted as its U+FFFD). Decodes the held tokens: for logprobs' text offsets."""
        return len(self.text) + self._stops.pending + self._detok.held

    def feed(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        head = ""
        if self._unarmed:  # the tokens that may not complete a stop string go through first, unarmed
            early, token_ids = token_ids[: self._unarmed], token_ids[self._unarmed :]
            self._unarmed -= len(early)
            head, _ = self._feed(early, finished and not token_ids, armed=False)
            if not token_ids:
                return head, False
        out, stopped = self._feed(token_ids, finished, armed=True)
        return head + out, stopped

    def _feed(self, token_ids: list[int], finished: bool, armed: bool) -> tuple[str, bool]:
        text = self._detok.feed(token_ids)
        if finished:
            text += self._detok.flush()
        out, stopped = self._stops.feed(text, final=finished, armed=armed)
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

"""A tiny byte-level BPE tokenizer for the gateway tests, in a module of its own (tokenizers and transformers
only), so the CUDA tests can build it on a machine without the server's packages."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a byte-level BPE vocabulary is written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Printable ASCII, space, the bytes of 'é' and '€' (so characters split across tokens), a few merges."""
    chars = byte_chars()
    tokens = SPECIALS + [chars[b] for b in range(32, 127)] + [chars[b] for b in sorted(set("é€".encode()))]
    merges = [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o"), (chars[32], "w"), ("o", "r")]
    merges += [("a", c) for c in "bcdefghijklmnopqrstuvwxyz"]
    tokens += [a + b for a, b in merges]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[2], bos_token=SPECIALS[1])

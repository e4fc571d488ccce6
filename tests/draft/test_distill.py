"""Distillation on tiny random targets: the dense trainer matches the serving forward, a few KL steps
lower the loss, and ``python -m draft.distill`` writes a draft that loads and speculates losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from draft.dense_lm import student_from_teacher, teacher_from_checkpoint
from draft.distill import draft_config, main
from draft.distill_train import teacher_targets, train
from draft.params import SpeculationParams
from engine_util import random_weights, tiny_config
from gateway.llm import LLM, LoadConfig
from target.batch import Segment, build_batch
from target.loader import LoadedCheckpoint, load_checkpoint, save_hf_dir
from target.model import Transformer
from verify.sampling import SamplingParams

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over printable ASCII (space and newline as their byte-level characters)."""
    tokens = SPECIALS + ["Ġ", "Ċ"] + [chr(c) for c in range(33, 127)]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[2], bos_token=SPECIALS[1])


def tiny_target(tmp_path: Path) -> Path:
    tok = tiny_tokenizer()
    cfg = tiny_config(vocab=len(tok), layers=3, eos_token_ids=(2,))
    return save_hf_dir(LoadedCheckpoint(cfg, random_weights(cfg, scale=0.1), tok, TEMPLATE, "tiny"), tmp_path / "target")


def test_dense_teacher_matches_serving_forward() -> None:
    cfg = tiny_config(vocab=64, layers=2)
    weights = random_weights(cfg)
    tokens = [3, 17, 5, 60, 22, 9, 41]
    target = Transformer.from_weights(cfg, weights)
    cache = target.new_cache(8, 4)
    ref = target.forward(build_batch([Segment(cache.new_table(), 0, tokens, logits="all")], cache, "cpu"), cache)
    got = teacher_from_checkpoint(cfg, weights)(torch.tensor([tokens]))[0]  # [T, V]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_a_few_kl_steps_lower_the_loss() -> None:
    cfg = tiny_config(vocab=64, layers=4)
    teacher = teacher_from_checkpoint(cfg, random_weights(cfg))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(64, (int(n),), generator=g).tolist() for n in torch.randint(8, 24, (16,), generator=g)]
    data = teacher_targets(teacher, seqs, k=16)
    student = student_from_teacher(teacher, draft_config(cfg, 1, None, 64))
    losses = train(student, data, steps=40, lr=1e-2, batch_size=4, seed=0, warmup=2)
    assert all(l >= 0 for l in losses)
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses


def test_distill_command_writes_a_loadable_lossless_draft(tmp_path: Path) -> None:
    target = tiny_target(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\nCount to five.\nName a colour.\nWrite a word.\n")
    out = tmp_path / "draft"
    main(["--target", str(target), "--out", str(out), "--layers", "1", "--intermediate", "64", "--steps", "4",
          "--max-tokens", "12", "--top-k", "8", "--batch-size", "2", "--prompts", str(prompts), "--seed", "3"])
    config = json.loads((out / "config.json").read_text())
    assert config["specgate_shared_embeddings"] and config["num_hidden_layers"] == 1
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not any("embed" in n or "lm_head" in n for n in f.keys())  # reattached from the target on load
    assert load_checkpoint(out).shared_embeddings
    assert json.loads((out / "distill.json").read_text())["seed"] == 3
    llm = LLM.load(LoadConfig(model=str(target), draft=str(out), quantize="none"), log=lambda m: None)
    assert llm.engine.drafters["draft"].model.num_layers == 1
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    asks = ["Say hello.", "Hello world"]
    off = llm.generate(asks, greedy, SpeculationParams(enabled=False))
    on = llm.generate(asks, greedy, SpeculationParams(drafter="draft", tree=(2, 2, 1)))
    assert [g.token_ids for g in on] == [g.token_ids for g in off]
    assert sum(g.stats.drafted_tokens for g in on) > 0

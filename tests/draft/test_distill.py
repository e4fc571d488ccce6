"""Distillation on tiny random targets: the dense trainer matches the serving forward, a few KL steps
lower the loss, and ``python -m draft.distill`` writes a draft that loads and speculates losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from draft.dense_lm import student_from_teacher, teacher_from_checkpoint
from draft.distill import Corpus, draft_config, main, write_prompts
from draft.distill_train import Tokens, evaluate, feature_loss, teacher_targets, train
from draft.feature_drafter import FeatureDrafter
from draft.ngram import TABLE_FILE, NgramTable
from draft.params import SpeculationParams
from draft.vocab import COUNTS_FILE, load_counts, main as vocab_main
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


def test_corpus_holds_out_whole_prompts_and_reads_the_earlier_format() -> None:
    corpus = Corpus([[1, 2, 3]] * 8, [2] * 8, [0, 1, 2, 3, 0, 1, 2, 3])  # two samples of four prompts
    train_idx, val_idx = corpus.split(2)
    assert val_idx == [1, 3, 5, 7] and train_idx == [0, 2, 4, 6]  # prompts 1 and 3, both of their samples
    assert corpus.split(0) == (list(range(8)), [])
    again = Corpus.from_json(corpus.to_json())
    assert (again.sequences, again.prompt_lens, again.prompt_index) == (corpus.sequences, [2] * 8, corpus.prompt_index)
    legacy = Corpus.from_json("[[5, 6], [7, 8, 9]]")
    assert legacy.prompt_lens == [0, 0] and legacy.prompt_index == [0, 1]


def test_evaluate_scores_only_the_sampled_positions() -> None:
    """A student that is the whole teacher agrees everywhere; a one-layer student does not, and where a
    sequence's scoring starts changes what is counted."""
    cfg = tiny_config(vocab=64, layers=2)
    teacher = teacher_from_checkpoint(cfg, random_weights(cfg))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(64, (n,), generator=g).tolist() for n in (9, 14, 6)]
    data = teacher_targets(teacher, seqs, k=64, starts=[3, 0, 5])
    same = evaluate(student_from_teacher(teacher, draft_config(cfg, 2, None, None)), data, batch_size=2)
    assert same["positions"] == (9 - 3) + 14 + (6 - 5)
    assert same["top1"] == 1.0 and abs(same["kl"]) < 1e-3  # logp is stored in fp16
    small = student_from_teacher(teacher, draft_config(cfg, 1, None, 16))
    assert evaluate(small, data)["kl"] > 1e-2
    assert evaluate(small, teacher_targets(teacher, seqs, k=64))["positions"] == 9 + 14 + 6


def test_self_instruct_adds_prompts_the_target_wrote(tmp_path: Path) -> None:
    """The target opens a user turn and writes requests; finished, distinct ones join the prompt list, are
    answered like the file's and reproduce under the same seed."""
    target = tiny_target(tmp_path)
    llm = LLM.load(LoadConfig(model=str(target), draft="none", quantize="none"), log=lambda m: None)
    written = write_prompts(llm, 16, seed=5, batch=8, max_tokens=64)  # a random model ends about half its turns
    assert written == write_prompts(llm, 16, seed=5, batch=8, max_tokens=64)
    assert 1 <= len(written) <= 16 and len(set(written)) == len(written)
    assert all(w and "\n" not in w for w in written)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\nCount to five.\n")
    out = tmp_path / "draft"
    main(["--target", str(target), "--out", str(out), "--layers", "1", "--steps", "2", "--max-tokens", "6",
          "--top-k", "8", "--batch-size", "2", "--prompts", str(prompts), "--self-instruct", "16", "--val-every", "0"])
    meta = json.loads((out / "distill.json").read_text())
    assert meta["self_instruct"] == 16 and meta["prompts"] > 2 and meta["sequences"] == meta["prompts"]


def test_distill_command_writes_a_loadable_lossless_draft(tmp_path: Path) -> None:
    target = tiny_target(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\nCount to five.\nName a colour.\nWrite a word.\n")
    out = tmp_path / "draft"
    main(["--target", str(target), "--out", str(out), "--layers", "1", "--intermediate", "64", "--steps", "4",
          "--max-tokens", "12", "--top-k", "8", "--batch-size", "2", "--prompts", str(prompts), "--seed", "3",
          "--val-every", "4"])
    meta = json.loads((out / "distill.json").read_text())
    assert (meta["sequences"], meta["val_sequences"]) == (3, 1)  # the fourth prompt is held out
    assert meta["val_positions"] > 0 and 0.0 <= meta["val_top1"] <= 1.0 and meta["val_kl"] >= 0.0
    config = json.loads((out / "config.json").read_text())
    again = tmp_path / "again"  # the same run, scored against the first draft: the same student, saved in bf16
    main(["--target", str(target), "--out", str(again), "--layers", "1", "--intermediate", "64", "--steps", "4",
          "--max-tokens", "12", "--top-k", "8", "--batch-size", "2", "--prompts", str(prompts), "--seed", "3",
          "--val-every", "4", "--baseline", str(out)])
    meta2 = json.loads((again / "distill.json").read_text())
    assert meta2["val_kl"] == meta["val_kl"] and meta2["val_positions_baseline"] == meta["val_positions"]
    assert abs(meta2["val_kl_baseline"] - meta["val_kl"]) < 0.01 * meta["val_kl"]
    assert config["specgate_shared_embeddings"] and config["num_hidden_layers"] == 1
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not any("embed" in n or "lm_head" in n for n in f.keys())  # reattached from the target on load
    assert load_checkpoint(out).shared_embeddings
    assert json.loads((out / "distill.json").read_text())["seed"] == 3
    llm = LLM.load(LoadConfig(model=str(target), draft=str(out), quantize="none"), log=lambda m: None)
    assert llm.engine.drafters["draft"].model.num_layers == 1
    # the n-gram drafter's table of the same corpus (draft/ngram.py), found beside the draft
    assert llm.engine.drafters["ngram"].table.entries == NgramTable.load(out / TABLE_FILE).entries
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    asks = ["Say hello.", "Hello world"]
    off = llm.generate(asks, greedy, SpeculationParams(enabled=False))
    on = llm.generate(asks, greedy, SpeculationParams(drafter="draft", tree=(2, 2, 1)))
    assert [g.token_ids for g in on] == [g.token_ids for g in off]
    assert sum(g.stats.drafted_tokens for g in on) > 0
    # the corpus's continuation tokens rank a cut head (FR-Spec, draft/vocab.py); EOS always makes the cut
    assert sum(load_counts(out).values()) > 0
    cut = LLM.load(LoadConfig(model=str(target), draft=str(out), quantize="none", draft_vocab=64), log=lambda m: None)
    drafter = cut.engine.drafters["draft"]
    assert drafter.model.logits_width == 64 < len(tiny_tokenizer()) and 2 in drafter.vocab_ids.tolist()
    on = cut.generate(asks, greedy, SpeculationParams(drafter="draft", tree=(2, 2, 1)))
    assert [g.token_ids for g in on] == [g.token_ids for g in off]
    assert sum(g.stats.drafted_tokens for g in on) > 0
    (out / COUNTS_FILE).unlink()
    with pytest.raises(ValueError, match=COUNTS_FILE):
        LLM.load(LoadConfig(model=str(target), draft=str(out), quantize="none", draft_vocab=64), log=lambda m: None)
    # python -m draft.vocab samples counts for a draft that has none (and refuses a directory holding no draft)
    vocab_main(["--target", str(target), "--out", str(out), "--prompts", str(prompts), "--num-prompts", "2",
                "--samples", "1", "--temperature", "0", "--max-tokens", "5", "--batch", "2"])
    counts = json.loads((out / COUNTS_FILE).read_text())
    assert counts["tokens"] == sum(counts["counts"].values()) > 0 and counts["source"].startswith("python -m draft.vocab")
    with pytest.raises(ValueError, match="no draft"):
        vocab_main(["--target", str(target), "--out", str(tmp_path), "--prompts", str(prompts)])
    # ... and with --write table the n-gram table, into any directory, leaving out every 2nd prompt line
    vocab_main(["--target", str(target), "--out", str(tmp_path / "table"), "--prompts", str(prompts), "--num-prompts",
                "0", "--samples", "1", "--temperature", "0", "--max-tokens", "8", "--batch", "2", "--write", "table",
                "--skip-every", "2", "--table-min-count", "1"])
    table = NgramTable.find(tmp_path / "table")
    assert table.entries and table.source.startswith("python -m draft.vocab") and "(2 prompts" in table.source
    with pytest.raises(ValueError, match="draft_vocab"):
        LoadConfig(draft_vocab=10)


def test_dense_feature_student_matches_the_serving_forward() -> None:
    """The trainer's feature draft and the serving Transformer built from its weights agree, features in."""
    cfg = tiny_config(vocab=64, layers=2)
    teacher = teacher_from_checkpoint(cfg, random_weights(cfg))
    student = student_from_teacher(teacher, draft_config(cfg, 1, None, None), feature=True, seed=1)
    tokens = [3, 17, 5, 60, 22, 9]
    feats = torch.randn(len(tokens), cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    weights = student.hf_weights() | {"model.embed_tokens.weight": teacher.embed, "lm_head.weight": teacher.head}
    serving = Transformer.from_weights(student.config, weights)
    cache = serving.new_cache(8, 4)
    batch = build_batch([Segment(cache.new_table(), 0, tokens, logits="all")], cache, "cpu")
    ref_logits, ref_h = serving.forward_hidden(batch, cache, feats)
    logits, h = student.forward_hidden(torch.tensor([tokens]), feats[None])
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h[0], ref_h, rtol=1e-4, atol=1e-4)


def test_a_few_feature_steps_lower_the_loss() -> None:
    cfg = tiny_config(vocab=64, layers=4)
    teacher = teacher_from_checkpoint(cfg, random_weights(cfg))
    g = torch.Generator().manual_seed(0)
    seqs = [Tokens(torch.randint(64, (int(n),), generator=g)) for n in torch.randint(8, 24, (16,), generator=g)]
    student = student_from_teacher(teacher, draft_config(cfg, 1, None, None), feature=True)
    losses = train(student, seqs, steps=40, lr=1e-2, batch_size=4, seed=0, warmup=2,
                   loss_fn=lambda st, b: feature_loss(st, teacher, b, k=16))
    assert all(l >= 0 for l in losses)
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses


def test_distill_feature_command_writes_a_feature_draft_that_speculates_losslessly(tmp_path: Path) -> None:
    target = tiny_target(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\nCount to five.\nName a colour.\nWrite a word.\n")
    out = tmp_path / "feature"
    main(["--target", str(target), "--out", str(out), "--layers", "1", "--steps", "4", "--feature",
          "--max-tokens", "12", "--top-k", "8", "--batch-size", "2", "--prompts", str(prompts), "--seed", "3"])
    config = json.loads((out / "config.json").read_text())
    assert config["specgate_feature_draft"] and config["specgate_shared_embeddings"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "fc.weight" in f.keys() and not any("embed" in n or "lm_head" in n for n in f.keys())
    assert json.loads((out / "distill.json").read_text())["kind"] == "feature"
    llm = LLM.load(LoadConfig(model=str(target), draft=str(out), quantize="none"), log=lambda m: None)
    drafter = llm.engine.drafters["draft"]
    assert isinstance(drafter, FeatureDrafter) and llm.engine.drafters["hybrid"].wants_features
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    asks = ["Say hello.", "Hello world"]
    off = llm.generate(asks, greedy, SpeculationParams(enabled=False))
    for name in ("draft", "hybrid"):
        on = llm.generate(asks, greedy, SpeculationParams(drafter=name, tree=(2, 2, 1)))
        assert [g.token_ids for g in on] == [g.token_ids for g in off]
        assert sum(g.stats.drafted_tokens for g in on) > 0
    assert drafter.cache.pool.num_free == drafter.cache.pool.num_blocks and not drafter._feats

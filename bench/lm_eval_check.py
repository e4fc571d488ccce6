"""lm-eval against the server, checked against lm-eval on Hugging Face transformers over the same weights.

Runs the server on a model directory with ``--quantize none`` (the dense weights, float32 on the CPU) and
speculation on, then lm-evaluation-harness twice over two toy tasks written for this check
(``bench/lm_eval/``): ``local-completions`` against the server (its remote tokenizer found through
``/tokenizer_info`` and ``/tokenize``; loglikelihood as batches of token-id prompts with ``echo`` and
``logprobs``; generation as batches of prompts with stop strings) and ``hf`` on the directory itself. Each
loglikelihood and each greedy continuation is compared per request.

lm-eval needs packages of its own: give it a Python that has ``lm-eval[api]``, torch and transformers
(a separate virtual environment; nothing here imports it).

    python bench/lm_eval_check.py --lm-eval-python VENV/bin/python [--model DIR] [--batch-size 4]
                                  [--out bench/results/lm_eval_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402

TASKS = ("specgate_mc", "specgate_gen")
TASK_DIR = ROOT / "bench" / "lm_eval"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become ready")


def lm_eval(python: str, model: str, model_args: str, out: Path, batch_size: int, extra: list[str]) -> float:
    """One lm-eval run over TASKS; returns its wall seconds."""
    cmd = [python, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--batch_size",
           str(batch_size), "--tasks", ",".join(TASKS), "--include_path", str(TASK_DIR), "--log_samples",
           "--output_path", str(out), *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=TASK_DIR, env=os.environ | OFFLINE, check=True)
    return time.perf_counter() - t0


def samples(out: Path, task: str) -> dict[int, dict]:
    (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    return {d["doc_id"]: d for d in map(json.loads, Path(path).read_text().splitlines())}


def results(out: Path) -> dict:
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())["results"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval-python", required=True, help="a Python with lm-eval[api], torch and transformers")
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "specgate" / "smollm2-135m-instruct"),
                    help="a Hugging Face model directory (default: the embedded model's dense conversion)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lm_eval_cpu.json"))
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port), "--model", args.model,
                               "--quantize", "none", "--draft", "ngram"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, server)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            served = json.loads(r.read())["data"][0]["id"]
        with tempfile.TemporaryDirectory() as tmp:
            via_server, via_hf = Path(tmp) / "server", Path(tmp) / "hf"
            server_s = lm_eval(args.lm_eval_python, "local-completions",
                               f"model={served},base_url={url}/v1/completions,num_concurrent=1,max_retries=1",
                               via_server, args.batch_size, [])
            hf_s = lm_eval(args.lm_eval_python, "hf", f"pretrained={args.model},dtype=float32", via_hf,
                           args.batch_size, ["--device", "cpu"])
            mc = [samples(d, "specgate_mc") for d in (via_server, via_hf)]
            gen = [samples(d, "specgate_gen") for d in (via_server, via_hf)]
            scores = [results(d) for d in (via_server, via_hf)]
    finally:
        server.terminate()
        server.wait(30)

    pairs = [(float(a[0]), float(b[0]), a[1] == b[1]) for doc in mc[0]
             for a, b in zip(mc[0][doc]["filtered_resps"], mc[1][doc]["filtered_resps"])]
    same_text = [gen[0][doc]["resps"][0][0] == gen[1][doc]["resps"][0][0] for doc in gen[0]]
    out = {
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "date": datetime.date.today().isoformat(), "commit": provenance.commit(),
        "model": Path(args.model).name, "dtype": "float32", "quantize": "none", "server_drafter": "ngram",
        "batch_size": args.batch_size,
        "loglikelihood_requests": len(pairs),
        "loglikelihood_max_abs_diff": max(abs(a - b) for a, b, _ in pairs),
        "is_greedy_agree": sum(same for _, _, same in pairs),
        "generations": len(same_text), "generations_identical": sum(same_text),
        "acc": {"server": scores[0]["specgate_mc"]["acc,none"], "hf": scores[1]["specgate_mc"]["acc,none"]},
        "exact_match": {"server": scores[0]["specgate_gen"]["exact_match,strip"],
                        "hf": scores[1]["specgate_gen"]["exact_match,strip"]},
        "wall_s": {"server": round(server_s, 1), "hf": round(hf_s, 1)},
        "loglikelihoods": {"server": [round(a, 6) for a, _, _ in pairs], "hf": [round(b, 6) for _, b, _ in pairs]},
        "notes": ["lm-eval local-completions against the server (remote tokenizer from /tokenizer_info and "
                  "/tokenize; loglikelihood as token-id prompt batches with echo and logprobs 1) beside lm-eval "
                  "hf on the same directory, one run each. Toy tasks (bench/lm_eval): the accuracies say nothing "
                  "about the model; the per-request agreement checks the server's logprobs, echo and batching "
                  "against an independent implementation. wall_s includes each harness's start-up."],
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(out, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in out.items() if k != "loglikelihoods"}, indent=2))


def plot(res: dict, path: Path) -> None:
    """Each loglikelihood request: the server's figure against transformers', and their difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    server, hf = res["loglikelihoods"]["server"], res["loglikelihoods"]["hf"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot(hf, server, "o", ms=3)
    lo, hi = min(hf + server), max(hf + server)
    a.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    a.set_xlabel("lm-eval hf (transformers)")
    a.set_ylabel("lm-eval local-completions (server)")
    a.set_title("loglikelihood per request")
    b.plot(range(len(hf)), [s - h for s, h in zip(server, hf)], "o", ms=3)
    b.set_xlabel("request")
    b.set_ylabel("server - transformers")
    b.set_title(f"max |diff| {res['loglikelihood_max_abs_diff']:.1e}")
    fig.suptitle(f"{res['model']} {res['dtype']}, {res['device']}, {res['date']}, {res['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

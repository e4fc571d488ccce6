"""How often a draft's top token equals the target's, teacher-forced, on the target's own greedy text.

The engine's accepted length mixes the draft's quality with tree shape, the adaptive budget and batching.
This is the draft alone: the target (dense, float32) writes a greedy continuation of each held-out prompt;
at every continuation position the draft sees the true prefix -- and, for a feature draft, the target's
true features -- and its argmax is compared with the target's. A feature draft also reports the second
step, fed its own first-step features (what tree depth 2 sees). Minutes on a CPU for a few prompts:

    python bench/draft_agreement.py --drafts draft/weights/smollm2-135m-instruct DIR2 --prompts 6

Writes ``--out`` JSON: per draft, ``top1`` (and ``top1_step2`` for a feature draft) over all positions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draft.dense_lm import DenseLM, draft_from_checkpoint, teacher_from_checkpoint  # noqa: E402
from gateway.llm import LoadConfig, resolve_model_path  # noqa: E402
from provenance import commit  # noqa: E402
from target.loader import load_checkpoint  # noqa: E402

MT_BENCH = ROOT / ".cache" / "mt_bench.jsonl"


@torch.no_grad()
def greedy_texts(teacher: DenseLM, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], int]]:
    """Each prompt plus the target's greedy continuation, and the prompt's length."""
    out = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(new_tokens):  # full recompute: a few dozen tokens of a small model
            seq.append(int(teacher(torch.tensor([seq], device=teacher.embed.device))[0, -1].argmax()))
        out.append((seq, len(ids)))
    return out


@torch.no_grad()
def agreement(draft: DenseLM, teacher: DenseLM, texts: list[tuple[list[int], int]]) -> dict:
    hits, hits2, n = 0, 0, 0
    for seq, P in texts:
        x = torch.tensor([seq], device=teacher.embed.device)
        t_logits, t_feat = teacher.forward_hidden(x)
        want = t_logits[0].argmax(-1)  # [T]: the target's next token after each position
        rows = torch.arange(P - 1, len(seq) - 1, device=x.device)  # positions whose next token is generated
        if draft.feature:  # row j reads token j + 1 and the target's feature of position j
            logits, h = draft.forward_hidden(x[:, 1:], t_feat[:, :-1])
            got = logits[0].argmax(-1)[rows - 1]
            own = torch.cat((t_feat[:, :1], h[:, :-1]), dim=1)  # the draft's own features, one step on
            got2 = draft.forward_hidden(x[:, 1:], own)[0][0].argmax(-1)[rows - 1]
            hits2 += int((got2 == want[rows]).sum())
        else:
            got = draft(x)[0].argmax(-1)[rows]
        hits += int((got == want[rows]).sum())
        n += len(rows)
    res = {"positions": n, "top1": round(hits / n, 4)}
    if draft.feature:
        res["top1_step2"] = round(hits2 / n, 4)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model (default: the embedded SmolLM2)")
    ap.add_argument("--drafts", nargs="+", required=True, help="draft model directories")
    ap.add_argument("--prompts-file", default=str(MT_BENCH))
    ap.add_argument("--prompts", type=int, default=6, help="first N prompts (first turns)")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_checkpoint(resolve_model_path(LoadConfig(model=args.target)), torch.float32)
    teacher = teacher_from_checkpoint(target.config, target.weights).to(args.device)
    tok = target.tokenizer
    questions = [json.loads(line)["turns"][0] for line in open(args.prompts_file)][: args.prompts]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in questions]
    texts = greedy_texts(teacher, prompts, args.new_tokens)
    rows = []
    for path in args.drafts:
        draft = draft_from_checkpoint(path, target).to(args.device)
        rows.append({"draft": path, "layers": draft.config.num_layers, "feature": draft.feature,
                     **agreement(draft, teacher, texts)})
        print(rows[-1], flush=True)
    report = {"date": datetime.date.today().isoformat(), "commit": commit(), "device": args.device,
              "target": Path(target.source).name, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""verify/processing.py: the step's batched bias and penalty pass gives every tree row what
``apply_penalties`` gives it alone, with the output before the root and the row's own path counted."""

from __future__ import annotations

import torch

from draft.tree import TokenTree
from verify.processing import PenaltyState, process_rows, stripped
from verify.sampling import SamplingParams, apply_penalties, tree_path_counts

V = 40


def test_batched_rows_equal_apply_penalties_row_by_row() -> None:
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=0.6),
              SamplingParams(logit_bias={4: 3.0, 7: -5.0}),
              SamplingParams(repetition_penalty=0.8, logit_bias={1: 1.0})]
    prompts = [[1, 2, 3, 2], [5, 6], [7, 7, 8]]
    outputs = [[9, 3, 9], [], [10, 11]]  # the second sequence's root is its prompt's last token
    trees = [TokenTree.from_lists([9, 3, 12, 9], [-1, 0, 0, 1]), TokenTree.root_only(6),
             TokenTree.from_lists([11, 11, 2], [-1, 0, 1])]
    sizes = [t.num_nodes for t in trees]
    starts = [2, 2 + sizes[0], 2 + sizes[0] + sizes[1]]  # two rows of another sequence come first
    logits = torch.randn(2 + sum(sizes), V, generator=g) * 3
    states = [PenaltyState.new(p, pr, out, V, torch.device("cpu")) for p, pr, out in zip(params, prompts, outputs)]
    got = process_rows(logits, [(s, s + n) for s, n in zip(starts, sizes)], params, states, trees)
    assert torch.equal(got[:2], logits[:2])  # rows of other sequences untouched
    for p, pr, out, tree, s, n in zip(params, prompts, outputs, trees, starts, sizes):
        mask = torch.zeros(V, dtype=torch.bool)
        mask[pr] = True
        before_root = torch.bincount(torch.tensor(out[:-1] if out else [], dtype=torch.int64), minlength=V)
        if not out:
            before_root[pr[-1]] -= 1
        want = apply_penalties(logits[s : s + n], p, mask, before_root, tree_path_counts(tree, V))
        torch.testing.assert_close(got[s : s + n], want, rtol=0, atol=0)
    states[0].emit([12, 12])  # emitted tokens count from then on
    assert states[0].counts[12].item() == 2 and states[0].counts[9].item() == 2


def test_stripped_params_have_nothing_left_to_process() -> None:
    p = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.2, logit_bias={3: 1.0}, seed=4)
    s = stripped(p)
    assert not s.custom_logits and (s.temperature, s.top_k, s.seed) == (0.7, 5, 4)

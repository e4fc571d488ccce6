"""verify.sampling: parameter validation, penalties, processing and seeded draws."""

from __future__ import annotations

import pytest
import torch

from draft.tree import TokenTree
from verify.sampling import (SamplingParams, apply_penalties, draws_without_replacement, inverse_cdf, make_generator,
                             process_logits, process_rows, race_argmax, race_scores, sample, sample_rows,
                             tree_path_counts)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -1),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", -3.0),
    ("max_tokens", 0),
    ("stop_token_ids", (-1,)),
])
def test_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_defaults_and_flags() -> None:
    params = SamplingParams()
    assert not params.is_greedy and not params.use_penalties
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(repetition_penalty=1.1).use_penalties
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]


def test_make_generator_is_seeded() -> None:
    params = SamplingParams(seed=1234)
    a = torch.rand(8, generator=make_generator(params))
    b = torch.rand(8, generator=make_generator(params))
    assert torch.equal(a, b)
    unseeded = SamplingParams()
    assert make_generator(unseeded).initial_seed() != make_generator(unseeded).initial_seed()


def _penalties_ref(logits: list[float], params: SamplingParams, prompt: set[int], counts: list[int]) -> list[float]:
    """One row, token by token: the spec written plainly."""
    out = []
    for tok, x in enumerate(logits):
        if tok in prompt or counts[tok] > 0:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        x -= params.frequency_penalty * counts[tok] + params.presence_penalty * (counts[tok] > 0)
        out.append(x)
    return out


def test_apply_penalties_matches_reference() -> None:
    v = 7
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(0))  # [N, V]
    params = SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.5)
    prompt_mask = torch.zeros(v, dtype=torch.bool)
    prompt_mask[[0, 6]] = True
    output_counts = torch.tensor([0, 2, 0, 1, 0, 0, 0])
    path_counts = torch.tensor([[0, 0, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 3, 0]])
    got = apply_penalties(logits, params, prompt_mask, output_counts, path_counts)
    assert got.dtype == torch.float32
    for i in range(3):
        counts = (output_counts + path_counts[i]).tolist()
        want = _penalties_ref(logits[i].tolist(), params, {0, 6}, counts)
        torch.testing.assert_close(got[i], torch.tensor(want))


def test_apply_penalties_neutral_is_a_no_op() -> None:
    logits = torch.randn(2, 5)
    out = apply_penalties(logits, SamplingParams(), torch.ones(5, dtype=torch.bool), torch.ones(5, dtype=torch.int64))
    assert out is logits


def test_repetition_penalty_signs() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    counts = torch.tensor([1, 1, 0, 0])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), None, counts)
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_tree_path_counts() -> None:
    #      0(t=4)
    #     /      \
    #  1(t=2)   2(t=4)
    #    |
    #  3(t=2)
    tree = TokenTree.from_lists([4, 2, 4, 2], [-1, 0, 0, 1])
    counts = tree_path_counts(tree, 5)
    assert counts.dtype == torch.int64
    for node in range(4):
        want = torch.bincount(tree.tokens[tree.path_to(node)], minlength=5)
        assert torch.equal(counts[node], want)
    assert counts[3].tolist() == [0, 0, 2, 0, 1] and counts[2].tolist() == [0, 0, 0, 0, 2]


def test_process_logits_greedy_is_one_hot() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    probs = process_logits(logits, SamplingParams(temperature=0))
    assert probs.dtype == torch.float32 and probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_process_logits_temperature() -> None:
    logits = torch.randn(4, 9, dtype=torch.bfloat16)
    probs = process_logits(logits, SamplingParams(temperature=0.5))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float() * 2, -1))


def test_top_k() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = process_logits(logits, SamplingParams(top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, True, False, False]
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))
    assert torch.equal(process_logits(logits, SamplingParams(top_k=9)), process_logits(logits, SamplingParams()))


def test_top_p() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = process_logits(logits, SamplingParams(top_p=0.7))
    assert (kept[0] > 0).tolist() == [False, True, False, True]  # 0.5 + 0.3 reaches 0.7
    torch.testing.assert_close(kept[0, [1, 3]], torch.tensor([0.5, 0.3]) / 0.8)
    only_top = process_logits(logits, SamplingParams(top_p=1e-6))
    assert only_top.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # at least one token survives


def test_top_k_then_top_p() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    probs = process_logits(logits, SamplingParams(top_k=3, top_p=0.6))
    # after top-k: softmax of [1, 2, 3] = [0.090, 0.245, 0.665] -> the nucleus is token 3 alone
    assert probs.tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_sample_shapes_and_seed() -> None:
    probs = torch.softmax(torch.randn(3, 6), -1)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert a.shape == (3,) and a.dtype == torch.int64 and torch.equal(a, b)
    assert sample(probs[0], torch.Generator().manual_seed(7)).shape == ()


def test_sample_frequencies() -> None:
    probs = torch.tensor([0.1, 0.6, 0.3])
    draws = sample(probs.expand(30_000, 3), torch.Generator().manual_seed(3))  # [30000]
    freq = torch.bincount(draws, minlength=3) / draws.numel()
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sample_rows_makes_each_rows_own_draw(device: str) -> None:
    """Row i of sample_rows is the draw sample(probs[i], generator i) makes: batching rows that each have
    their own generator changes no request's tokens (inverse CDF on the CPU, the exponential race on CUDA)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 50, generator=g), -1) * (torch.rand(6, 50, generator=g) > 0.3)  # zeros too
    probs = probs.to(device)
    for seed in range(20):
        gens = [torch.Generator(device).manual_seed(seed * 10 + i) for i in range(6)]
        one_by_one = [int(sample(probs[i], torch.Generator(device).manual_seed(seed * 10 + i))) for i in range(6)]
        assert sample_rows(probs, gens).tolist() == one_by_one
        assert all(probs[i, t] > 0 for i, t in enumerate(one_by_one))


def test_race_argmax_follows_the_distribution() -> None:
    """The CUDA draw, run here on CPU tensors: frequencies match the probabilities."""
    probs = torch.tensor([0.1, 0.6, 0.3, 0.0]).expand(30_000, 4)
    race = torch.empty(probs.shape).exponential_(generator=torch.Generator().manual_seed(3))
    freq = torch.bincount(race_argmax(probs, race), minlength=4) / probs.shape[0]
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.6, 0.3, 0.0]), atol=0.015, rtol=0)


def test_race_argmax_never_draws_a_zero_probability_token() -> None:
    """Exponential draws of exactly zero, on tokens with and without mass."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75], [0.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.0, 0.0]])  # [3, 4]
    race = torch.tensor([[0.0, 2.0, 1.0, 9.0], [1.0, 0.0, 0.0, 5.0], [1.0, 0.0, 0.0, 1.0]])
    # 0.25 / 2 > 0.75 / 9; row 2: 0.5 / 0 = inf, a token with mass
    assert race_argmax(probs, race).tolist() == [1, 3, 1]


def test_inverse_cdf_never_draws_a_zero_probability_token() -> None:
    """Zero-mass tokens inside and at the end of a row, against the smallest and the largest uniforms, and
    against uniforms that land exactly on a running sum."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 4 + [[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])  # [5, 6]
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    u = torch.tensor([0.0, 0.25, 0.2499999, float(below_one), 0.5], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 3, 1, 3, 1]


def test_draws_without_replacement_follow_successive_draws() -> None:
    """The CPU's draws without replacement: the first draw follows p, the ordered pair (i, j) comes with
    probability p_i p_j / (1 - p_i), and no token repeats in a row; the race's top-k (CUDA's form) gives the
    same pair frequencies on the same probabilities."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    n = 40_000
    u = torch.rand(n, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    drawn, ok = draws_without_replacement(p.expand(n, 4), u)
    assert ok.all() and (drawn[:, 0] != drawn[:, 1]).all() and (drawn < 3).all()
    race = torch.empty(n, 4).exponential_(generator=torch.Generator().manual_seed(6))
    raced = race_scores(p.expand(n, 4), race).topk(2, dim=-1).indices
    want = torch.tensor([[p[i] * p[j] / (1 - p[i]) if i != j else 0.0 for j in range(4)] for i in range(4)])
    for pairs in (drawn, raced):
        freq = torch.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16).view(4, 4) / n
        torch.testing.assert_close(freq, want, atol=0.01, rtol=0)


def test_draws_without_replacement_flag_the_draws_past_the_support() -> None:
    """Two tokens with mass and four draws: the first two are those tokens, in some order, and the last two
    are flagged as drawn from nothing. Leading dimensions come back as given."""
    p = torch.tensor([[[0.0, 0.4, 0.0, 0.6, 0.0]]]).expand(2, 3, 5)
    u = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    drawn, ok = draws_without_replacement(p, u)
    assert drawn.shape == ok.shape == (2, 3, 4)
    assert ok[..., :2].all() and not ok[..., 2:].any()
    assert sorted(drawn[0, 0, :2].tolist()) == [1, 3]
    assert all(sorted(r[:2]) == [1, 3] for r in drawn.reshape(-1, 4).tolist())


def test_process_rows_gives_each_row_what_process_logits_gives_it() -> None:
    """Per-row knobs in one pass: every row equals process_logits with its own knobs, ties with the k-th
    logit, -inf columns (a cut head's) and rows with neither filter included."""
    g = torch.Generator().manual_seed(0)
    V = 40
    logits = torch.randn(6, 3, V, generator=g) * 3
    logits[1, :, :8] = 2.5  # ties across the top-k boundary
    logits[2, :, ::3] = float("-inf")
    knobs = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.5, 4, 0.9), (2.0, V, 1.0), (0.9, 1, 0.3)]
    temp = torch.tensor([k[0] for k in knobs])
    top_k = torch.tensor([k[1] for k in knobs])
    top_p = torch.tensor([k[2] for k in knobs])
    out = process_rows(logits, temp, top_k, top_p)
    for b, (t, k, p) in enumerate(knobs):
        want = process_logits(logits[b], SamplingParams(temperature=t, top_k=k, top_p=p))
        torch.testing.assert_close(out[b], want, rtol=1e-6, atol=0)
        assert torch.equal(out[b] > 0, want > 0)
    plain = process_rows(logits[[0, 4]], temp[[0, 4]], top_k[[0, 4]], top_p[[0, 4]], filtered=False)
    torch.testing.assert_close(plain, out[[0, 4]], rtol=1e-6, atol=0)


def test_logit_bias_is_normalised_and_added_before_penalties() -> None:
    params = SamplingParams(logit_bias={5: 1, 2: -3})
    assert params.logit_bias == ((2, -3.0), (5, 1.0)) and params.custom_logits and not params.use_penalties
    assert not SamplingParams().custom_logits
    logits = torch.tensor([[1.0, 2.0, 0.5, 0.0, 0.0, 0.0]])
    out = apply_penalties(logits, params, None, None)
    assert out.tolist() == [[1.0, 2.0, -2.5, 0.0, 0.0, 1.0]]
    # vLLM's order: bias first, then the repetition penalty divides the biased (positive) logit
    both = SamplingParams(logit_bias={0: 1.0}, repetition_penalty=2.0)
    out = apply_penalties(logits, both, torch.tensor([True, False, False, False, False, False]), None)
    assert out[0, 0].item() == 1.0 and out[0, 1].item() == 2.0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_penalties(logits, SamplingParams(logit_bias={6: 1.0}), None, None)


def test_min_p_keeps_tokens_at_least_that_share_of_the_most_likely() -> None:
    probs = torch.tensor([0.5, 0.2, 0.1, 0.049, 0.151])
    logits = probs.log()[None]
    out = process_logits(logits, SamplingParams(min_p=0.2))[0]  # keeps p >= 0.1
    kept = probs * torch.tensor([1.0, 1, 1, 0, 1])
    torch.testing.assert_close(out, kept / kept.sum())
    hot = process_logits(logits, SamplingParams(min_p=0.2, temperature=0.5))[0]  # after temperature: p^2
    sq = probs**2
    kept = sq * (sq >= 0.2 * sq.max())
    torch.testing.assert_close(hot, kept / kept.sum())
    assert process_logits(logits, SamplingParams(min_p=1.0))[0].argmax() == 0  # the most likely always stays
    assert torch.equal(process_logits(logits, SamplingParams(min_p=0.0)), process_logits(logits, SamplingParams()))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad)

"""chain_inputs: the Triton kernel (interpreted on the CPU) against the torch reference, with a step pending
and without, on chains of mixed depths."""

from __future__ import annotations

import pytest
import torch

from kernels.chain_inputs import chain_inputs, chain_inputs_ref


def case(seed: int, ahead: bool, page: int = 4):
    g = torch.Generator().manual_seed(seed)
    depths = [0, 3, 1, 4, 2][: 3 + seed % 3]
    B, K = len(depths), max(depths)
    cols = 12
    row_seq = torch.cat([torch.full((k + 1,), b) for b, k in enumerate(depths)])
    row_at = torch.cat([torch.arange(k + 1) for k in depths])
    base = torch.randint(0, 20, (B,), generator=g)  # each chain's num_cached
    positions = (base[row_seq] + row_at).to(torch.int64)
    block_tables = torch.randperm(B * cols, generator=g).view(B, cols).to(torch.int32)
    slot_mapping = torch.full_like(positions, -7)  # the host's slots: replaced where a step is pending
    context_lens = base.to(torch.int32)
    lens = base + 1
    hist = torch.randint(0, 1000, (B, 64), generator=g)
    drafts = torch.randint(0, 1000, (B, K), generator=g)
    advance = torch.randint(1, 6, (B,), generator=g) if ahead else None
    tokens = torch.full_like(positions, -1)
    return [tokens, positions, slot_mapping, context_lens, block_tables, hist, lens, drafts, advance, row_seq,
            row_at, page]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ahead", [False, True])
def test_the_kernel_matches_the_reference(seed: int, ahead: bool) -> None:
    want, got = case(seed, ahead), case(seed, ahead)
    chain_inputs_ref(*want)
    chain_inputs(*got, use_triton=True, block=4)
    for w, o in zip(want[:4], got[:4]):  # tokens, positions, slots, context lengths
        assert torch.equal(w, o)
    if ahead:  # the reference itself: positions moved, slots of the moved positions, each root from hist
        tokens, positions, slots, ctx, bt, hist, lens, drafts, adv, row_seq, row_at, page = want
        assert torch.equal(slots, bt[row_seq, positions // page].long() * page + positions % page)
    roots = want[0][want[10] == 0]
    assert torch.equal(roots, want[5].gather(1, (want[6] - 1)[:, None])[:, 0])


def test_rows_must_be_contiguous() -> None:
    args = case(0, True)
    args[1] = args[1].repeat(2)[::2]  # positions strided
    with pytest.raises(ValueError, match="positions"):
        chain_inputs(*args, use_triton=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ahead", [False, True])
def test_the_compiled_kernel_matches_the_reference_on_cuda(ahead: bool) -> None:
    want = [t.cuda() if isinstance(t, torch.Tensor) else t for t in case(1, ahead)]
    got = [t.clone() if isinstance(t, torch.Tensor) else t for t in want]
    chain_inputs_ref(*want)
    chain_inputs(*got)
    assert all(torch.equal(w, o) for w, o in zip(want[:4], got[:4]))

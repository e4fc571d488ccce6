"""kernels/stochastic_accept: the one-launch stochastic tree verification against its torch reference plus an
exponential race (interpreter on CPU, compiled on CUDA), on the same draws: every node's accepted child, bonus
and zero-probability flag."""

import pytest
import torch

from kernels.stochastic_accept import residual_decisions_ref, stochastic_accept

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_nodes(R: int, V: int, K: int, has_q: bool, g: torch.Generator, zero_q: bool = False):
    """R node rows: target rows with zeros (a top-k / top-p cut), draft rows (or none), up to K children with
    distinct tokens each (some rows none), sibling uniforms and race noise."""
    p = torch.softmax(torch.randn(R, V, generator=g) * 2, -1) * (torch.rand(R, V, generator=g) > 0.2)
    q = torch.softmax(torch.randn(R, V, generator=g) * 2, -1) if has_q else None
    kid = torch.full((R, K), -1, dtype=torch.int64)
    tok = torch.zeros(R, K, dtype=torch.int64)
    for r in range(R):
        toks = torch.randperm(V, generator=g)[: int(torch.randint(0, K + 1, (), generator=g))]
        kid[r, : len(toks)] = torch.arange(1, len(toks) + 1)
        tok[r, : len(toks)] = toks
        if zero_q and q is not None and len(toks) > 1:
            q[r, toks[1]] = 0.0  # a child the draft could not have drawn: the flag names it
    u = torch.rand(R, K, generator=g)
    race = torch.empty(R, V).exponential_(generator=g)
    move = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return move(p), move(q), move(kid), move(tok), move(u), move(race)


def reference(p, q, kid, tok, u, race) -> torch.Tensor:
    child, bad, final = residual_decisions_ref(p, q, kid, tok, u)
    bonus = torch.where(final > 0, final / race, -1.0).argmax(-1)
    return torch.cat((child, bonus, bad.long()))


@pytest.mark.parametrize("has_q", [True, False], ids=["draft_probs", "point_masses"])
@pytest.mark.parametrize("R,V,K", [(12, 300, 3), (5, 1024, 1), (9, 2100, 5)])
def test_the_kernel_decides_what_the_reference_decides(has_q: bool, R: int, V: int, K: int) -> None:
    """Vocabularies below, at and past one block of the kernel's pass; one child a node to five; several draws."""
    g = torch.Generator().manual_seed(R * V + K + has_q)
    for _ in range(3):
        args = random_nodes(R, V, K, has_q, g)
        got = stochastic_accept(*args)
        assert torch.equal(got, reference(*args))


def test_rejections_down_to_the_last_child_and_the_flag_of_a_zero_probability_draft_token() -> None:
    """The target gives no mass to any child: every child is rejected, so the residual chain runs its full depth
    before the bonus, which then avoids every child; a child with no draft probability raises the flag."""
    g = torch.Generator().manual_seed(7)
    p, q, kid, tok, u, race = random_nodes(16, 700, 4, True, g, zero_q=True)
    p = p.scatter(1, tok, 0.0)
    got = stochastic_accept(p, q, kid, tok, u, race)
    assert torch.equal(got, reference(p, q, kid, tok, u, race))
    R = p.shape[0]
    assert (got[:R] == -1).all()
    assert all(int(b) not in t for b, t in zip(got[R : 2 * R].tolist(), tok.tolist()))
    assert got[2 * R :].any()  # the zero-probability child was tried somewhere


def test_the_poisoned_output_is_fully_written() -> None:
    """One row, no children at all: the kernel still writes its child (-1), bonus and flag."""
    g = torch.Generator().manual_seed(3)
    p, q, kid, tok, u, race = random_nodes(1, 64, 2, True, g)
    kid = torch.full_like(kid, -1)
    got = stochastic_accept(p, q, kid, tok, u, race)
    assert got.tolist()[0] == -1 and got.tolist()[2] == 0
    assert got.tolist()[1] == int((p[0] / race[0]).argmax())

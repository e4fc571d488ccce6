"""Per-request speculation knobs (the A/B switch) and tree templates."""

from __future__ import annotations

from dataclasses import dataclass

from draft.tree import MAX_TREE_NODES

DEFAULT_TREE = (2, 2, 2, 1)  # widths per depth: 1 root + 7 draft nodes


def parse_tree(spec: str) -> tuple[int, ...]:
    """``"4,2,2,1"`` -> (4, 2, 2, 1): the number of draft nodes kept at each depth."""
    try:
        widths = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"tree must be comma-separated widths per depth, like 2,2,1; got {spec!r}") from None
    check_widths(widths)
    return widths


def check_widths(widths: tuple[int, ...]) -> None:
    if any(w < 1 for w in widths):
        raise ValueError(f"tree widths must be >= 1, got {widths}")
    if 1 + sum(widths) > MAX_TREE_NODES:
        raise ValueError(f"tree has {1 + sum(widths)} nodes; at most {MAX_TREE_NODES}")


def widths_for_budget(widths: tuple[int, ...], max_nodes: int) -> tuple[int, ...]:
    """Trim a template, deepest level first, until root + drafts fit in ``max_nodes``."""
    w = list(widths)
    while w and 1 + sum(w) > max_nodes:
        excess = 1 + sum(w) - max_nodes
        if w[-1] > excess:
            w[-1] -= excess
        else:
            w.pop()
    return tuple(w)


@dataclass(frozen=True, slots=True)
class SpeculationParams:
    """``enabled=False`` gives a one-node tree: plain decoding inside the same batch."""

    enabled: bool = True
    drafter: str | None = None  # None = the engine's default drafter
    tree: tuple[int, ...] | None = None  # widths per depth; None = the drafter's default
    max_nodes: int | None = None  # tree budget including the root; trims the template

    def __post_init__(self) -> None:
        if self.tree is not None:
            check_widths(self.tree)
        if self.max_nodes is not None and not 1 <= self.max_nodes <= MAX_TREE_NODES:
            raise ValueError(f"speculation.max_nodes must be in 1..{MAX_TREE_NODES}, got {self.max_nodes}")

    def widths(self, default: tuple[int, ...]) -> tuple[int, ...]:
        if not self.enabled:
            return ()
        w = self.tree if self.tree is not None else default
        return widths_for_budget(w, self.max_nodes) if self.max_nodes is not None else w

"""The kernel benches' PNGs: a results JSON's figure, finished the same way and written beside it."""

from __future__ import annotations


def save_beside(fig, ax, json_path: str, legend_cols: int = 2) -> str:
    """Legend, layout, and ``fig`` as PNG next to ``json_path`` (same name); returns the PNG's path."""
    ax.legend(fontsize=7, ncol=legend_cols)
    fig.tight_layout()
    out = json_path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out

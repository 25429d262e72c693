"""`search.png`: every candidate's fitness against its evaluation number, with the best-so-far line."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_search(history: list[dict[str, Any]], path: Path) -> bool:
    """Draw the picture (matplotlib, headless); False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    xs = [r["evaluation"] for r in history]
    ys = [r["fitness"] for r in history]
    best, running = [], float("-inf")
    for y in ys:
        running = max(running, y)
        best.append(running)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.scatter(xs, ys, s=12, alpha=0.6, label="candidate")
    ax.step(xs, best, where="post", color="C3", label="best so far")
    ax.set_xlabel("evaluation")
    ax.set_ylabel("fitness (weighted task score)")
    ax.set_title("mergesmith evolve")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return True

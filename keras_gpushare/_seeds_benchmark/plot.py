"""`keras-gpushare bench --plot`: throughput against members, one line per method, as a PNG.

matplotlib comes with the `[bench]` extra and is imported only when a plot is asked for.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
from typing import Any

logger = logging.getLogger(__name__)

Results = list[tuple[str, int, dict[str, Any]]]


def check_plot_path(path: str) -> None:
    """Raises before any benchmark runs when the plot could not be written.

    Raises:
        ValueError: matplotlib is missing, the path does not end in `.png`, or its folder
            does not exist.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            f"Invalid value for --plot: got {path!r}, but plotting needs matplotlib, which is "
            "not installed. Install it with `pip install 'keras-gpushare[bench]'` (or "
            "`pip install matplotlib`), or leave out --plot."
        )
    if not path.lower().endswith(".png"):
        raise ValueError(
            f"Invalid value for --plot: got {path!r}. Pass a file name ending in .png, e.g. "
            "--plot bench.png."
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(
            f"Invalid value for --plot: got {path!r}, but the folder {folder} does not exist."
        )


def series(results: Results) -> dict[str, list[tuple[int, float]]]:
    """Steady throughput per method: `{label: [(members, model-samples/s), ...]}`.

    A process pool with one process per member is labelled `pool(N)`; a pool of fixed size
    keeps its own label (`pool(2)`). Failed runs are left out.
    """
    lines: dict[str, list[tuple[int, float]]] = {}
    for method, n, result in results:
        rate = result.get("steady_rate")
        if "error" in result or rate is None or not math.isfinite(rate):
            continue
        match = re.fullmatch(r"pool\((\d+)\)", method)
        label = "pool(N)" if match and int(match.group(1)) == n else method
        lines.setdefault(label, []).append((n, float(rate)))
    return {label: sorted(points) for label, points in lines.items()}


def plot_throughput(results: Results, path: str, title: str | None = None) -> None:
    """Writes a PNG of steady throughput (model-samples/s) against members, one line per method.

    Args:
        results: `(method, members, measurements)` triples as the benchmark returns them.
        path: the PNG file to write.
        title: the figure title. Defaults to `None` (a standard title).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = series(results)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for label, points in lines.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=label)
        members = sorted({n for _, n, _ in results})
        if len(members) > 1 and members[0] > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(members, [str(n) for n in members])
        ax.set_xlabel("members (models trained at once)")
        ax.set_ylabel("steady model-samples / s")
        ax.set_title(title or "keras-gpushare bench: throughput vs members")
        ax.grid(True, alpha=0.3)
        if lines:
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    logger.info("bench: plot written to %s", path)

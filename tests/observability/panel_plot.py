"""A PNG of the Grafana dashboard's panels as Prometheus answers them (no Grafana needed): one
small chart per panel, one line per series of each target, from /api/v1/query_range. Written by
the dashboard test when PDSERVE_SCREENSHOT_DIR is set."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any


def plot_panels(path: Path, panels: list[tuple[str, list[tuple[str, str]]]],
                query_range: Callable[[str], list[dict[str, Any]]]) -> None:
    """panels: (title, [(expr, legend format)]); query_range(expr) -> Prometheus matrix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 4.6, rows * 2.6), squeeze=False)
    for ax, (title, targets) in zip(axes.flat, panels):
        for expr, legend in targets:
            for series in query_range(expr):
                labels = series["metric"]
                name = legend
                for key, value in labels.items():
                    name = name.replace("{{" + key + "}}", value.removeprefix("http://"))
                name = re.sub(r"\{\{\w+\}\}", "", name).strip() or expr[:40]  # unmatched
                t0 = float(series["values"][0][0])
                xs = [float(t) - t0 for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, label=name[:40])
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("pdserve PD cluster (deploy/grafana/pdserve.json), queried from Prometheus "
                 "during the test's load; x: seconds", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)

"""PNG plots of an experiment's ``results.json``: one line per configuration.

Three figures, each with one panel per numerics: validation accuracy against step,
validation accuracy against forward passes (the cost that matters on the boards), and
q against step (the mean over seeds, so a policy whose raises differ between seeds
shows fractional steps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import numpy as np

__all__ = ["PLOT_FILES", "plot_results"]

PLOT_FILES: Final = ("accuracy_vs_step.png", "accuracy_vs_forward_passes.png", "q_vs_step.png")


def _q_per_step(changes: list[list[int]], steps: int) -> Any:
    out = np.zeros(steps)
    for i, (start, q) in enumerate(changes):
        stop = changes[i + 1][0] if i + 1 < len(changes) else steps
        out[start:stop] = q
    return out


def _style(config: dict[str, Any]) -> dict[str, Any]:
    """Fixed q: thin lines in a sequential colour map; adaptive policies: thick, distinct."""
    import matplotlib

    name = config["policy"]["name"]
    if name == "fixed":
        q = int(config["policy"]["config"].get("q", 8))
        shade = min(1.0, 0.25 + 0.75 * np.log2(q) / 5)
        return {"color": matplotlib.colormaps["Blues"](shade), "linewidth": 1.2, "linestyle": "-"}
    colours = {
        "qscheduler": "tab:red",
        "linear": "tab:green",
        "power": "tab:purple",
        "variance": "tab:orange",
    }
    return {
        "color": colours.get(name, "tab:brown"),
        "linewidth": 2.2,
        "linestyle": "-" if name == "qscheduler" else "--",
    }


def _panels(
    doc: dict[str, Any],
    title: str,
    xlabel: str,
    ylabel: str,
    draw: Any,
    path: Path,
    log_x: bool = False,
    log_y: bool = False,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = list(dict.fromkeys(c["numerics_token"] for c in doc["configs"]))
    fig, axes = plt.subplots(
        1, len(tokens), figsize=(6.0 * len(tokens), 4.2), squeeze=False, sharey=True
    )
    for ax, token in zip(axes[0], tokens, strict=True):
        for config in (c for c in doc["configs"] if c["numerics_token"] == token):
            draw(ax, config, _style(config))
        ax.set_title(f"{token}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if log_x:
            ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log", base=2)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7, loc="best")
    spec = doc["setting"]["spec"]
    fig.suptitle(
        f"{title}: {spec['dataset']} / {spec['model']}, {len(doc['setting']['seeds'])} seeds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_results(doc: dict[str, Any], out: Path) -> list[Path]:
    """Draw the three figures of an experiment.

    Args:
        doc: the ``results.json`` document.
        out: the folder to write the PNG files to.

    Returns:
        The files written (:data:`PLOT_FILES` in ``out``).
    """

    def acc_step(ax: Any, c: dict[str, Any], style: dict[str, Any]) -> None:
        curve = c["curve"]
        ax.plot(
            curve["step"], 100 * np.asarray(curve["val_accuracy_mean"]), label=c["label"], **style
        )

    def acc_passes(ax: Any, c: dict[str, Any], style: dict[str, Any]) -> None:
        curve = c["curve"]
        ax.plot(
            curve["forward_passes_mean"],
            100 * np.asarray(curve["val_accuracy_mean"]),
            label=c["label"],
            **style,
        )

    def q_step(ax: Any, c: dict[str, Any], style: dict[str, Any]) -> None:
        qs = np.mean([_q_per_step(t["changes"], c["steps"]) for t in c["q_trajectory"]], axis=0)
        ax.step(np.arange(c["steps"]), qs, where="post", label=c["label"], **style)

    names = [out / name for name in PLOT_FILES]
    return [
        _panels(doc, "Validation accuracy", "step", "validation accuracy (%)", acc_step, names[0]),
        _panels(
            doc,
            "Validation accuracy per cost",
            "forward passes",
            "validation accuracy (%)",
            acc_passes,
            names[1],
            log_x=True,
        ),
        _panels(doc, "q", "step", "q (mean over seeds)", q_step, names[2], log_y=True),
    ]

"""The report of a distillation run: ``metrics.json``, ``loss_curves.png`` and ``index.html``."""

from __future__ import annotations

import html
import json
from pathlib import Path


def write_report(folder: Path, metrics: dict) -> Path:
    """Write the report of ``metrics`` (``bits_per_byte``: name -> value; ``runs``: run name ->
    per-step metrics) into ``folder``; returns the HTML page's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, history in metrics["runs"].items():
        steps = range(1, len(history) + 1)
        axes[0].plot(steps, [h["ce"] for h in history], label=f"{name}: CE")
        axes[1].plot(steps, [h["kd"] for h in history], label=f"{name}: KD")
    for ax, title in zip(axes, ("student CE (nats/token)", "CSD KD term"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "loss_curves.png", dpi=100)
    plt.close(fig)
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{value:.4f}</td></tr>"
        for name, value in metrics["bits_per_byte"].items()
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>crosskd report</title></head>"
        "<body><h1>crosskd distillation report</h1>"
        "<h2>Held-out bits per byte (lower is better)</h2>"
        f"<table border='1' cellpadding='4'><tr><th>model</th><th>bits/byte</th></tr>{rows}"
        "</table><h2>Loss curves</h2><img src='loss_curves.png' alt='loss curves'>"
        "<h2>Configuration</h2><pre>"
        f"{html.escape(json.dumps(metrics.get('config', {}), indent=1, default=str))}</pre>"
        "</body></html>"
    )
    path = folder / "index.html"
    path.write_text(page)
    return path

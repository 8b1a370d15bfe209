"""The report of a distillation run: ``metrics.json``, ``loss_curves.png``, ``index.html`` (one
self-contained page: the plot is inlined as a base64 PNG, so it shows in the KFP UI's sandboxed
iframe as well as from the folder) and ``summary.md``."""

from __future__ import annotations

import base64
import html
import io
import json

import fsspec


def write_report(folder: str, metrics: dict) -> str:
    """Write the report of ``metrics`` (``bits_per_byte``: name -> value; ``runs``: run name ->
    per-step metrics; ``config``: shown as is) into ``folder`` (any fsspec URI); returns the
    HTML page's URI."""
    fs, root = fsspec.core.url_to_fs(folder)
    fs.makedirs(root, exist_ok=True)
    png = loss_curves_png(metrics["runs"])
    fs.pipe_file(f"{root}/metrics.json", json.dumps(metrics, indent=1, default=str).encode())
    fs.pipe_file(f"{root}/loss_curves.png", png)
    fs.pipe_file(f"{root}/index.html", report_html(metrics, png).encode("utf-8"))
    fs.pipe_file(f"{root}/summary.md", report_markdown(metrics).encode("utf-8"))
    return f"{folder.rstrip('/')}/index.html"


def loss_curves_png(runs: dict[str, list[dict]]) -> bytes:
    """Student CE and KD term per optimizer step of every run, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, history in runs.items():
        steps = [h.get("step", i + 1) for i, h in enumerate(history)]
        axes[0].plot(steps, [h["ce"] for h in history], label=f"{name}: CE")
        axes[1].plot(steps, [h["kd"] for h in history], label=f"{name}: KD")
    for ax, title in zip(axes, ("student CE (nats/token)", "CSD KD term"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def report_html(metrics: dict, png: bytes) -> str:
    """The report page: bits-per-byte table, the loss curves inline, the configuration."""
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{value:.4f}</td></tr>"
        for name, value in metrics["bits_per_byte"].items()
    )
    image = base64.b64encode(png).decode("ascii")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>crosskd report</title></head>"
        "<body><h1>crosskd distillation report</h1>"
        "<h2>Held-out bits per byte (lower is better)</h2>"
        f"<table border='1' cellpadding='4'><tr><th>model</th><th>bits/byte</th></tr>{rows}"
        "</table><h2>Loss curves</h2>"
        f"<img src='data:image/png;base64,{image}' alt='loss curves (loss_curves.png)'>"
        "<h2>Configuration</h2><pre>"
        f"{html.escape(json.dumps(metrics.get('config', {}), indent=1, default=str))}</pre>"
        "</body></html>"
    )


def report_markdown(metrics: dict) -> str:
    """The bits-per-byte table and each run's last step as Markdown."""
    lines = ["# crosskd distillation report", "", "Held-out bits per byte (lower is better):",
             "", "| model | bits/byte |", "|---|---|"]  # fmt: skip
    lines += [f"| {name} | {value:.4f} |" for name, value in metrics["bits_per_byte"].items()]
    for name, history in metrics["runs"].items():
        if history:
            last = history[-1]
            lines += ["", f"Run `{name}`: {len(history)} steps, last CE {last['ce']:.4f}, "
                          f"KD {last['kd']:.4f}."]  # fmt: skip
    return "\n".join(lines) + "\n"

"""The report of a distillation run: ``metrics.json``, ``loss_curves.png``, ``speed.png``,
``index.html`` (one self-contained page: the plots are inlined as base64 PNGs, so it shows in the
KFP UI's sandboxed iframe as well as from the folder, with no network) and ``summary.md``."""

from __future__ import annotations

import base64
import html
import io
import json

import fsspec

from crosskd.metrics.contention import SHARE_BELOW, SPREAD_ABOVE, contention, nearest_rank


def write_report(folder: str, metrics: dict) -> str:
    """Write the report of ``metrics`` (``bits_per_byte``: name -> value on the in-domain
    held-out rows; ``ood_bits_per_byte``, optional: name -> value on the out-of-domain rows;
    ``runs``: run name -> per-step metrics; ``config``: shown as is) into ``folder`` (any
    fsspec URI); returns the HTML page's URI."""
    fs, root = fsspec.core.url_to_fs(folder)
    fs.makedirs(root, exist_ok=True)
    png = loss_curves_png(metrics["runs"])
    speed = speed_png(metrics["runs"])
    fs.pipe_file(f"{root}/metrics.json", json.dumps(metrics, indent=1, default=str).encode())
    fs.pipe_file(f"{root}/loss_curves.png", png)
    fs.pipe_file(f"{root}/speed.png", speed)
    fs.pipe_file(f"{root}/index.html", report_html(metrics, png, speed).encode("utf-8"))
    fs.pipe_file(f"{root}/summary.md", report_markdown(metrics).encode("utf-8"))
    return f"{folder.rstrip('/')}/index.html"


def loss_curves_png(runs: dict[str, list[dict]]) -> bytes:
    """Student CE and KD term per optimizer step of every run, as PNG bytes."""
    lines = []
    for name, history in runs.items():
        steps = [h.get("step", i + 1) for i, h in enumerate(history)]
        lines += [
            (0, steps, [h["ce"] for h in history], f"{name}: CE"),
            (1, steps, [h["kd"] for h in history], f"{name}: KD"),
        ]
    return _two_plots(("student CE (nats/token)", "CSD KD term"), lines)


def speed(history: list[dict]) -> dict[str, float]:
    """A run's throughput from its per-step records (``tokens``, ``seconds``): ``tokens_per_s``
    (all tokens over all step seconds), ``step_seconds_p50`` and ``step_seconds_p95`` (nearest
    rank). Empty where the records carry no step times."""
    timed = [h for h in history if h.get("seconds")]
    if not timed:
        return {}
    seconds = sorted(float(h["seconds"]) for h in timed)
    return {
        "tokens_per_s": sum(float(h.get("tokens", 0)) for h in timed) / sum(seconds),
        "step_seconds_p50": nearest_rank(seconds, 0.5),
        "step_seconds_p95": nearest_rank(seconds, 0.95),
    }


def speed_png(runs: dict[str, list[dict]]) -> bytes:
    """Tokens per second and seconds per optimizer step of every run, as PNG bytes."""
    lines = []
    for name, history in runs.items():
        timed = [h for h in history if h.get("seconds")]
        steps = [h.get("step", i + 1) for i, h in enumerate(timed)]
        lines += [
            (0, steps, [h.get("tokens", 0) / h["seconds"] for h in timed], name),
            (1, steps, [h["seconds"] for h in timed], name),
        ]
    return _two_plots(("student tokens per second", "seconds per optimizer step"), lines)


def _two_plots(titles: tuple[str, str], lines: list[tuple[int, list, list, str]]) -> bytes:
    """Two plots side by side over the optimizer step, as PNG bytes; ``lines``: (plot index,
    steps, values, label)."""
    # lazy: matplotlib (~0.3 s, its Agg backend chosen before pyplot) only to draw a report; every
    # pipeline step imports crosskd.steps, which imports this module (crosskd.steps.evaluate)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: pyplot only after the backend is chosen (above)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for index, steps, values, label in lines:
        axes[index].plot(steps, values, label=label)
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def report_html(metrics: dict, png: bytes, speed_plot: bytes) -> str:
    """The report page: bits-per-byte table, the loss curves inline, each run's tokens/s and
    step time (a table, with the signs that the run shared its machine, and a plot), the
    configuration."""
    header, table = bits_per_byte_rows(metrics)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in table
    )
    heads = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
    comparison = "".join(f"<p>{html.escape(line)}</p>" for line in kd_against_ce(metrics))
    speeds = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{s['tokens_per_s']:.1f}</td>"
        f"<td>{s['step_seconds_p50']:.3f}</td><td>{s['step_seconds_p95']:.3f}</td>"
        f"<td>{html.escape(shared_machine(h))}</td></tr>"
        for name, h in metrics["runs"].items()
        if (s := speed(h))
    )
    image = base64.b64encode(png).decode("ascii")
    speed_image = base64.b64encode(speed_plot).decode("ascii")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>crosskd report</title></head>"
        "<body><h1>crosskd distillation report</h1>"
        "<h2>Held-out bits per byte (lower is better)</h2>"
        f"<table border='1' cellpadding='4'><tr>{heads}</tr>{rows}</table>{comparison}"
        "<h2>Loss curves</h2>"
        f"<img src='data:image/png;base64,{image}' alt='loss curves (loss_curves.png)'>"
        "<h2>Speed</h2><table border='1' cellpadding='4'><tr><th>run</th><th>tokens/s</th>"
        "<th>step seconds p50</th><th>step seconds p95</th><th>shared the machine?</th></tr>"
        f"{speeds}</table><p>{html.escape(SHARED_NOTE)}</p>"
        f"<img src='data:image/png;base64,{speed_image}' alt='tokens/s and step time "
        "(speed.png)'>"
        "<h2>Configuration</h2><pre>"
        f"{html.escape(json.dumps(metrics.get('config', {}), indent=1, default=str))}</pre>"
        "</body></html>"
    )


SHARED_NOTE = (
    "A run marked as sharing its machine ran beside other work (its CPU share: the CPU seconds "
    f"of its steps over their wall time times its threads, below {SHARE_BELOW} on the CPU; or "
    f"its 95th-percentile step time above {SPREAD_ABOVE} times the median): its speed is not "
    "the method's cost. Compare speeds of runs that are not marked."
)


def shared_machine(history: list[dict]) -> str:
    """The speed table's cell on whether a run shared its machine
    (:func:`~crosskd.metrics.contention.contention`)."""
    signs = contention(history)
    if signs is None:
        return "unknown (no timed steps)"
    return "yes: " + "; ".join(signs) if signs else "no"


def bits_per_byte_rows(metrics: dict) -> tuple[list[str], list[list[str]]]:
    """The bits-per-byte table: its header and its rows (a model, its in-domain value, and its
    out-of-domain value when ``metrics`` has ``ood_bits_per_byte``), values to 4 decimals."""
    ood = metrics.get("ood_bits_per_byte")
    if not ood:
        return ["model", "bits/byte"], [
            [name, f"{value:.4f}"] for name, value in metrics["bits_per_byte"].items()
        ]
    rows = [
        [name, f"{value:.4f}", f"{ood[name]:.4f}" if name in ood else "n/a"]
        for name, value in metrics["bits_per_byte"].items()
    ]
    return ["model", "in-domain bits/byte", "out-of-domain bits/byte"], rows


def kd_against_ce(metrics: dict) -> list[str]:
    """One sentence per held-out set on the distilled student (``student_kd``) against the
    CE-only one (``student_ce``) and the untrained one (``student_init``); none without both
    trained students."""
    lines = []
    for key, where in (("bits_per_byte", "in domain"), ("ood_bits_per_byte", "out of domain")):
        bpb = metrics.get(key) or {}
        if not {"student_kd", "student_ce"} <= set(bpb):
            continue
        line = (
            f"{where.capitalize()}: the distilled student is at {bpb['student_kd']:.4f} "
            f"bits per byte, {bpb['student_kd'] - bpb['student_ce']:+.4f} against the CE-only "
            f"student ({bpb['student_ce']:.4f})"
        )
        if "student_init" in bpb:
            line += (
                f"; the untrained student is at {bpb['student_init']:.4f} (the CE-only "
                f"student {bpb['student_ce'] - bpb['student_init']:+.4f} from it)"
            )
        lines.append(line + ".")
    return lines


def report_markdown(metrics: dict) -> str:
    """The bits-per-byte table, the distilled student against the CE-only one, and each run's
    last step as Markdown."""
    header, table = bits_per_byte_rows(metrics)
    lines = [
        "# crosskd distillation report",
        "",
        "Held-out bits per byte (lower is better):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    if comparison := kd_against_ce(metrics):
        lines += ["", *comparison]
    for name, history in metrics["runs"].items():
        if history:
            last = history[-1]
            lines += [
                "",
                f"Run `{name}`: {len(history)} steps, last CE {last['ce']:.4f}, "
                f"KD {last['kd']:.4f}; shared the machine: {shared_machine(history)}.",
            ]
    return "\n".join(lines) + "\n"

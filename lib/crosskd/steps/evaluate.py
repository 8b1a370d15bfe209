"""Steps ``evaluate`` and ``report``: held-out bits per byte (in domain and, when the run has
out-of-domain rows, out of domain) of the teachers, the student before training and every
trained student, and the run's report."""

from __future__ import annotations

import logging
from typing import Any

from crosskd.evaluate import EvaluateConfig, evaluate
from crosskd.metrics.report import report_markdown, write_report
from crosskd.steps.locations import exists, read_json
from crosskd.steps.prepare import OOD
from crosskd.steps.train import run_history

log = logging.getLogger(__name__)


def models_to_evaluate(plan: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, str]:
    """Name -> model reference: ``teacher`` (``teacher0``, ``teacher1``, ... with several),
    ``student_init`` and ``student_<variant>`` of each training run (outputs of
    :func:`crosskd.steps.train.train`, any order)."""
    teachers = plan["teachers"]
    models = {
        ("teacher" if len(teachers) == 1 else f"teacher{int(t['index'])}"): t["ref"]
        for t in teachers
    }
    models["student_init"] = plan["student"]
    order = {"kd": 0, "ce": 1}
    for run in sorted(runs, key=lambda r: order.get(r["variant"], 2)):
        models[f"student_{run['variant']}"] = run["model"]
    return models


def in_order(bits_per_byte: dict[str, float]) -> dict[str, float]:
    """``bits_per_byte`` in the report's order: teachers, ``student_init``, ``student_kd``,
    ``student_ce``, then the rest by name (a dict that went through KFP lost its order)."""
    rank = {"student_init": 1, "student_kd": 2, "student_ce": 3}

    def key(name: str) -> tuple[int, int, str]:
        if name.startswith("teacher"):
            return (
                0,
                int(name[len("teacher") :] or 0) if name[len("teacher") :].isdigit() else 0,
                name,
            )
        return (rank.get(name, 4), 0, name)

    return {name: bits_per_byte[name] for name in sorted(bits_per_byte, key=key)}


def evaluate_models(
    data: str,
    models: dict[str, str],
    output: str,
    *,
    token_budget: int = 4096,
    device: str | None = None,
    tokens: str = "all",
) -> dict[str, Any]:
    """Bits per byte of each model of ``models`` on the held-out prepared data ``data``, written
    to ``output`` (JSON, :func:`crosskd.evaluate.evaluate`; ``tokens``: ``all`` or ``digits``,
    ``EvaluateConfig.tokens``); returns ``{"uri", "bits_per_byte": {name: value},
    "evaluation"}``. An existing result for the same data, models and tokens is returned at
    once."""
    wanted = [f"{name}={ref}" for name, ref in models.items()]
    if exists(output):
        earlier = read_json(output)
        if (
            earlier.get("data") == data
            and earlier.get("tokens", "all") == tokens
            and {n: m["ref"] for n, m in earlier["models"].items()} == dict(models)
        ):
            log.info("evaluation %s exists", output)
            return _summary(output, earlier)
    result = evaluate(
        EvaluateConfig(
            data=data,
            models=wanted,
            output=output,
            token_budget=int(token_budget),
            device=device,
            tokens=tokens,
        )
    )
    return _summary(output, result)


def evaluate_run(
    prepared: dict[str, Any],
    models: dict[str, str],
    folder: str,
    *,
    token_budget: int = 4096,
    device: str | None = None,
) -> dict[str, Any]:
    """:func:`evaluate_models` on the prepared held-out rows (``<folder>/evaluation.json``) and,
    when ``prepared`` has them (:func:`crosskd.steps.prepare.prepare_data`), on the
    out-of-domain rows (``<folder>/evaluation_ood.json``); returns ``{"uri", "bits_per_byte",
    "ood_uri", "ood_bits_per_byte"}`` (the last two only with out-of-domain rows)."""
    folder = folder.rstrip("/")
    result = evaluate_models(
        prepared["heldout"],
        models,
        f"{folder}/evaluation.json",
        token_budget=token_budget,
        device=device,
    )
    summary = {"uri": result["uri"], "bits_per_byte": result["bits_per_byte"]}
    if prepared.get(OOD):
        ood = evaluate_models(
            prepared[OOD],
            models,
            f"{folder}/evaluation_{OOD}.json",
            token_budget=token_budget,
            device=device,
        )
        summary |= {"ood_uri": ood["uri"], "ood_bits_per_byte": ood["bits_per_byte"]}
    return summary


def bits_per_byte_table(
    bits_per_byte: dict[str, float], ood_bits_per_byte: dict[str, float] | None = None
) -> list[str]:
    """The bits-per-byte lines the CLIs print, in the report's order: one column, or in-domain
    and out-of-domain columns."""
    bits_per_byte = in_order(bits_per_byte)
    if not ood_bits_per_byte:
        return [
            "held-out bits per byte:",
            *(f"  {name:14} {value:.4f}" for name, value in bits_per_byte.items()),
        ]
    lines = ["held-out bits per byte:", f"  {'':14} {'in-domain':>10} {'out-of-domain':>14}"]
    lines += [
        f"  {name:14} {value:10.4f} {ood_bits_per_byte.get(name, float('nan')):14.4f}"
        for name, value in bits_per_byte.items()
    ]
    return lines


def _summary(output: str, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "uri": output,
        "evaluation": result,
        "bits_per_byte": {n: m["bits_per_byte"] for n, m in result["models"].items()},
    }


def report(
    evaluation: dict[str, Any], runs: list[dict[str, Any]], config: dict[str, Any], folder: str
) -> dict[str, Any]:
    """The run's report under ``folder`` (:func:`crosskd.metrics.report.write_report`):
    ``evaluation`` from :func:`evaluate_run`, ``runs`` from :func:`crosskd.steps.train.train`;
    returns ``{"uri", "html", "markdown", "bits_per_byte", "ood_bits_per_byte"}`` (the last
    only with out-of-domain rows)."""
    order = sorted(runs, key=lambda r: ["kd", "ce"].index(r["variant"]))
    metrics = {
        "bits_per_byte": in_order(evaluation["bits_per_byte"]),
        "config": config,
        "runs": {r["variant"]: run_history(r["output"]) for r in order},
    }
    if evaluation.get("ood_bits_per_byte"):
        metrics["ood_bits_per_byte"] = in_order(evaluation["ood_bits_per_byte"])
    page = write_report(folder, metrics)
    log.info("report: %s", page)
    return {
        "uri": folder,
        "html": page,
        "markdown": report_markdown(metrics),
        **{k: metrics[k] for k in ("bits_per_byte", "ood_bits_per_byte") if k in metrics},
    }

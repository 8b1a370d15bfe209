"""Steps ``evaluate`` and ``report``: held-out bits per byte of the teachers, the student before
training and every trained student, and the run's report."""

from __future__ import annotations

import logging
from typing import Any

from crosskd.steps.locations import exists, read_json

log = logging.getLogger(__name__)


def models_to_evaluate(plan: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, str]:
    """Name -> model reference: ``teacher`` (``teacher0``, ``teacher1``, ... with several),
    ``student_init`` and ``student_<variant>`` of each training run (outputs of
    :func:`crosskd.steps.train.train`, any order)."""
    teachers = plan["teachers"]
    models = {("teacher" if len(teachers) == 1 else f"teacher{int(t['index'])}"): t["ref"]
              for t in teachers}  # fmt: skip
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
            return (0, int(name[len("teacher"):] or 0) if name[len("teacher"):].isdigit() else 0,
                    name)  # fmt: skip
        return (rank.get(name, 4), 0, name)

    return {name: bits_per_byte[name] for name in sorted(bits_per_byte, key=key)}


def evaluate_models(data: str, models: dict[str, str], output: str, *, token_budget: int = 4096,
                    device: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Bits per byte of each model of ``models`` on the held-out prepared data ``data``, written
    to ``output`` (JSON, :func:`crosskd.evaluate.evaluate`); returns ``{"uri",
    "bits_per_byte": {name: value}, "evaluation"}``. An existing result for the same data and
    models is returned at once."""
    from crosskd.evaluate import EvaluateConfig, evaluate

    wanted = [f"{name}={ref}" for name, ref in models.items()]
    if exists(output):
        earlier = read_json(output)
        if earlier.get("data") == data and {n: m["ref"] for n, m in earlier["models"].items()} \
                == dict(models):  # fmt: skip
            log.info("evaluation %s exists", output)
            return _summary(output, earlier)
    result = evaluate(EvaluateConfig(data=data, models=wanted, output=output,
                                     token_budget=int(token_budget), device=device))  # fmt: skip
    return _summary(output, result)


def _summary(output: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"uri": output, "evaluation": result,
            "bits_per_byte": {n: m["bits_per_byte"] for n, m in result["models"].items()}}


def report(evaluation: dict[str, Any], runs: list[dict[str, Any]], config: dict[str, Any],
           folder: str) -> dict[str, Any]:  # fmt: skip
    """The run's report under ``folder`` (:func:`crosskd.metrics.report.write_report`):
    ``evaluation`` from :func:`evaluate_models`, ``runs`` from :func:`crosskd.steps.train.train`;
    returns ``{"uri", "html", "markdown", "bits_per_byte"}``."""
    from crosskd.metrics.report import report_markdown, write_report
    from crosskd.steps.train import run_history

    order = sorted(runs, key=lambda r: ["kd", "ce"].index(r["variant"]))
    metrics = {"bits_per_byte": in_order(evaluation["bits_per_byte"]), "config": config,
               "runs": {r["variant"]: run_history(r["output"]) for r in order}}  # fmt: skip
    page = write_report(folder, metrics)
    log.info("report: %s", page)
    return {"uri": folder, "html": page, "markdown": report_markdown(metrics),
            "bits_per_byte": metrics["bits_per_byte"]}

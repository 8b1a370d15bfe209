"""``crosskd distill``: a whole run on one machine, the pipeline's steps called in order
(:mod:`crosskd.steps`; ``crosskd pipeline run-local`` runs the same steps as the KFP DAG).

validate inputs -> the student (moved onto ``student_tokenizer`` first when ``transplant``
is set) -> tables (built and validated, per teacher, and X-Token's projection from them) ->
prepare (train, held-out and out-of-domain rows) -> score each teacher (``teacher_scoring:
online``: no scoring, the training steps score their rows with the teachers in process) ->
train the student with CSD (or the algorithms ``algorithms`` names; and, to compare, with CE
only on the same budget) -> evaluate (held-out bits per byte of the
teachers and of the student before and after, in domain and, with ``ood_data``, out of
domain) -> report
(``metrics.json``, ``loss_curves.png``, ``index.html``, ``summary.md`` under
``output/report``).

Without data, the corpus is text already on the machine: Python standard-library docstrings and
sources and translation catalogues. Models are references (an HF folder, ``zoo:smollm2``, ...)
or ``init``: a random-init Llama of the given shape for the given tokenizer; a tokenizer
reference may be ``tiny:N`` (a byte-level BPE of N tokens trained on the training rows).
Presets ship with the package (``--preset tiny``, ``--preset demo``). Pure steps write under
content-addressed prefixes of ``output`` and are not redone; training runs (``output/kd``,
``output/ce``) resume from their checkpoints, so a rerun into the same output finishes an
interrupted run.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from crosskd import steps
from crosskd.steps.config import PRESETS, RunConfig, load_run_config, preset_path

log = logging.getLogger(__name__)

DistillConfig = RunConfig
__all__ = [
    "PRESETS",
    "DistillConfig",
    "checked_tables",
    "distill",
    "load_distill_config",
    "preset_path",
    "teacher_caches",
]


def load_distill_config(
    path: str | None,
    preset: str | None,
    overrides: list[str],
    flags: dict[str, Any] | None = None,
) -> RunConfig:
    """A preset (or none), then the file, then command-line ``flags``, then ``key=value``
    overrides (:func:`crosskd.steps.config.load_run_config`)."""
    return load_run_config(path, preset, overrides, flags=flags)


def distill(config: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run every step in this process (training in-process); returns the report's metrics
    (``bits_per_byte``, ``ood_bits_per_byte`` with out-of-domain rows, ``report``: the page's
    URI)."""
    root = config.output.rstrip("/")
    plan = steps.init_student(steps.validate_inputs(config))
    tables = checked_tables(plan, progress=progress)
    prepared = steps.prepare_data(plan, **config.preparing(), progress=progress)
    if config.teacher_scoring == "online":
        caches = steps.online_teachers(plan)
    else:
        caches = teacher_caches(
            plan, prepared, config.scoring(), config.score_pods, progress=progress
        )
    items = steps.plan_training(config, plan, prepared, tables, caches, root)
    runs = [steps.train(item, executor="inprocess", progress=progress) for item in items]
    evaluation = steps.evaluate_run(
        prepared,
        steps.models_to_evaluate(plan, runs),
        root,
        token_budget=config.token_budget,
        device=config.device,
    )
    result = steps.report(evaluation, runs, asdict(config), f"{root}/report")
    return {"report": result["html"], **{k: result[k] for k in result if "bits_per_byte" in k}}


def checked_tables(plan: dict[str, Any], *, progress: bool = True) -> list[dict[str, Any]]:
    """The tables and projection of every cross-tokenizer teacher of ``plan`` (steps
    ``plan_tables``, ``build_tables``, ``validate_tables``, ``build_projection``), in this
    process; the outputs of ``build_projection``."""
    tables = []
    for item in steps.plan_tables(plan):
        built = steps.build_tables(item, progress=progress)
        steps.validate_tables(item, built)
        tables.append(steps.build_projection(item, built))
    return tables


def teacher_caches(
    plan: dict[str, Any],
    prepared: dict[str, Any],
    scoring: dict[str, Any],
    pods: int,
    *,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Every teacher's cache of the prepared training data (steps ``plan_scoring`` over
    ``pods`` shard ranges, ``score_teacher``, ``merge_caches``), in this process; the output of
    ``merge_caches``. ``scoring``: ``RunConfig.scoring()`` keys."""
    jobs = steps.plan_scoring(plan, prepared, scoring, pods)
    return steps.merge_caches([steps.score_teacher(job, progress=progress) for job in jobs])

"""Every component's body called as a plain function (``python_func``), outside KFP, in the
order the pipeline runs them, on the ``tiny`` preset in a local folder (with out-of-domain
rows): each output is what the step functions give ``crosskd distill``, the pointer artifacts
name the data they point at, the Metrics and the report's HTML and Markdown are written where
KFP reads them. (``tests/test_pipeline.py`` runs the same components under ``kfp.local``.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from kfp import dsl

from crosskd.pipeline.run import preset_arguments
from crosskd.steps.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def components():
    sys.path.insert(0, str(ROOT))
    from components.build_projection.component import build_projection
    from components.build_tables.component import build_tables
    from components.evaluate.component import evaluate
    from components.init_student.component import init_student
    from components.merge_cache.component import merge_cache
    from components.plan_scoring.component import plan_scoring
    from components.plan_tables.component import plan_tables
    from components.plan_training.component import plan_training
    from components.prepare.component import prepare
    from components.report.component import report
    from components.score_teacher.component import score_teacher
    from components.train.component import train
    from components.validate_inputs.component import validate_inputs
    from components.validate_tables.component import validate_tables

    return {
        c.name.replace("-", "_"): c.python_func
        for c in (
            validate_inputs,
            init_student,
            prepare,
            plan_tables,
            build_tables,
            validate_tables,
            build_projection,
            plan_scoring,
            score_teacher,
            merge_cache,
            plan_training,
            train,
            evaluate,
            report,
        )
    }


def test_the_components_in_pipeline_order_give_what_distill_gives(components, tmp_path):
    from crosskd.distill import distill

    c = components
    config = load_run_config(
        None,
        "tiny",
        [
            f"output={tmp_path / 'root'}",
            "train.steps=3",
            "ood_data=machine:licences",
            "ood_bytes=2000",
            "score_pods=2",
            "shard_rows=16",
        ],
    )
    args = preset_arguments(config)
    n = iter(range(100))

    def artifact(kind=dsl.Artifact):
        return kind(uri=str(tmp_path / "kfp" / f"out-{next(n)}"))

    def pointer(a: dsl.Artifact) -> dict:
        return json.loads(Path(a.path).read_text())

    inputs = artifact()
    plan, preparing, scoring, run_config = c["validate_inputs"](
        output_root=args["output_root"],
        teachers=args["teachers"],
        student=args["student"],
        train_data=args["train_data"],
        heldout_data=args["heldout_data"],
        ood_data=args["ood_data"],
        k=args["k"],
        tau=args["tau"],
        steps=args["steps"],
        compare_ce_only=args["compare_ce_only"],
        score_pods=args["score_pods"],
        options=args["options"],
        executor="inprocess",
        job_kind="pytorchjob",
        image="i",
        gpus_per_node=0,
        nodes=1,
        job={},
        inputs=inputs,
    )
    assert pointer(inputs)["uri"] == plan["root"] == str(tmp_path / "root")
    assert plan["ood_data"].endswith("/ood.jsonl")
    student_figures = artifact(dsl.Metrics)
    assert c["init_student"](plan=plan, figures=student_figures) == plan  # no transplant

    outs = {split: artifact() for split in ("train", "heldout", "ood")}
    prepared = c["prepare"](plan=plan, preparing=preparing, metrics_port=-1, **outs)
    for split, out in outs.items():
        assert pointer(out)["uri"] == prepared[split]
        assert pointer(out)["rows"] == prepared["rows"][split] > 0

    tables = []
    for item in c["plan_tables"](plan=plan):
        built = c["build_tables"](item=item, tables=artifact())
        figures = artifact(dsl.Metrics)
        checked = c["validate_tables"](item=item, tables=built, figures=figures)
        assert checked["validated"] is True and Path(figures.path).exists()
        projected = artifact()
        tables.append(c["build_projection"](item=item, tables=checked, projection=projected))
        assert pointer(projected)["uri"] == tables[-1]["projection"]
        assert tables[-1]["projection"].endswith("/projection.safetensors")

    jobs = c["plan_scoring"](
        plan=plan, prepared=prepared, scoring=scoring, score_pods=args["score_pods"]
    )
    assert len(jobs) == 2  # one teacher, its shards split over two pods
    parts = []
    for job in jobs:
        part = artifact()
        parts.append(c["score_teacher"](job=job, gpus=0, metrics_port=-1, part=part))
        assert pointer(part)["uri"] == parts[-1]["cache"]
    caches_out = artifact()
    caches = c["merge_cache"](parts=parts, caches=caches_out)
    assert pointer(caches_out)["caches"] == caches

    runs = c["plan_training"](
        run_config=run_config,
        plan=plan,
        prepared=prepared,
        tables=tables,
        caches=caches,
        run_id="run-1",
    )
    assert [r["variant"] for r in runs] == ["kd", "ce"]
    trained = []
    for run in runs:
        model, figures = artifact(dsl.Model), artifact(dsl.Metrics)
        trained.append(
            c["train"](
                item=run,
                executor="inprocess",
                job_kind="pytorchjob",
                image="i",
                gpus_per_node=0,
                nodes=1,
                job={},
                s3_secret="",
                pipeline_job_id="run-1",
                task_name="train",
                model=model,
                figures=figures,
            )
        )
        assert pointer(model)["uri"] == trained[-1]["model"]
        assert f"{run['variant']}_final_ce" in figures.metadata

    evaluation_out, figures = artifact(), artifact(dsl.Metrics)
    evaluation = c["evaluate"](
        plan=plan,
        prepared=prepared,
        runs=trained,
        run_id="run-1",
        scoring=scoring,
        gpus=0,
        evaluation=evaluation_out,
        figures=figures,
    )
    assert (
        figures.metadata["ood_bits_per_byte_student_kd"]
        == evaluation["ood_bits_per_byte"]["student_kd"]
    )
    assert Path(figures.path).read_text()

    page, summary, folder = artifact(dsl.HTML), artifact(dsl.Markdown), artifact()
    shown = c["report"](
        plan=plan,
        evaluation=evaluation,
        runs=trained,
        run_config=run_config,
        run_id="run-1",
        page=page,
        summary=summary,
        folder=folder,
    )
    html = Path(page.path).read_text()
    assert html.startswith("<!doctype html>") and "out-of-domain bits/byte" in html
    assert "| student_kd |" in Path(summary.path).read_text()
    assert pointer(folder)["html"] == shown["report"]

    # One code path: crosskd distill on the same config finds the same pure outputs and trains
    # the same runs (in its own folder) to the same figures.
    expected = distill(config, progress=False)
    assert shown["bits_per_byte"] == expected["bits_per_byte"]
    assert shown["ood_bits_per_byte"] == expected["ood_bits_per_byte"]

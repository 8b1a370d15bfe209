"""The KFP pipeline (``pipelines/distill.py``) and its components: the compiled YAML is fresh;
every shipped parameter set compiles with the GPU step's accelerator, tolerations, node
selector, secrets, ``/dev/shm`` and timeout and a CPU-only training launcher; the components
import with nothing but the standard library and kfp; the ``tiny`` preset runs through the whole
DAG under ``kfp.local`` with data, caches and outputs on a moto S3 server, hits KFP's cache on
the pure steps when run again, misses it where an input changed, and a failing step fails the
pipeline with the step's own message; ``crosskd pipeline submit`` against FakeKfpApi."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from crosskd.metrics import read_jsonl_log
from crosskd.pipeline.run import COMPILED_FILE, compile_pipeline, preset_arguments, run_local
from crosskd.steps.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]
PURE = (
    "init-student",
    "plan-tables",
    "build-tables",
    "validate-tables",
    "build-projection",
    "prepare",
    "plan-scoring",
    "score-teacher",
    "merge-cache",
)


def _compiled(path: Path) -> tuple[dict, dict]:
    spec, platform = yaml.safe_load_all(path.read_text())
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_compiled_yaml_is_fresh(tmp_path, monkeypatch):
    """The committed file is what this checkout compiles to, byte for byte."""
    monkeypatch.delenv("CROSSKD_IMAGE", raising=False)
    monkeypatch.delenv("CROSSKD_CUDA_IMAGE", raising=False)
    out = tmp_path / "distill.yaml"
    compile_pipeline(str(out))
    assert out.read_text() == (ROOT / COMPILED_FILE).read_text(), (
        "pipelines/distill.yaml is stale: run `crosskd pipeline compile`"
    )


def test_two_compiles_in_two_processes_give_the_same_bytes(tmp_path):
    """kfp prints dict defaults in its header in protobuf's per-process map order; the compile
    writes that header again from the sorted spec. Two processes (two hash seeds as well)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSKD_")}
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"distill-{seed}.yaml"
        subprocess.run(
            [sys.executable, "-m", "crosskd.cli", "pipeline", "compile", "--output", str(out)],
            check=True,
            capture_output=True,
            env=env | {"PYTHONHASHSEED": seed},
        )
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    assert b"#    job: dict [Default: {'cpu': '2', 'memory': '4Gi'}]" in outputs[0]


@pytest.mark.parametrize(
    "params", sorted((ROOT / "pipelines" / "params").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_parameter_set_compiles_with_its_platform_settings(params, tmp_path):
    values = yaml.safe_load(params.read_text())
    out = tmp_path / "p.yaml"
    compile_pipeline(str(out), parameters=values)
    spec, executors = _compiled(out)
    defaults = {
        k: v.get("defaultValue") for k, v in spec["root"]["inputDefinitions"]["parameters"].items()
    }
    assert {k: defaults[k] for k in values} == values
    # The GPU step: accelerator from score_gpus, node selector and tolerations from parameters,
    # /dev/shm in memory, a deadline, S3 credentials from the Secret named by s3_secret.
    for gpu_step in ("exec-score-teacher", "exec-evaluate"):
        container = spec["deploymentSpec"]["executors"][gpu_step]["container"]
        accelerator = container["resources"]["accelerator"]
        assert accelerator["resourceType"] == "nvidia.com/gpu"
        assert "score_gpus" in accelerator["resourceCount"]
        assert container["image"].endswith("-cuda")
        score = executors[gpu_step]
        assert score["nodeSelector"]["nodeSelectorJson"]["componentInputParameter"].endswith(
            "score_node_selector"
        )
        assert score["tolerations"][0]["tolerationJson"]["componentInputParameter"].endswith(
            "score_tolerations"
        )
        assert score["emptyDirMounts"] == [
            {"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "16Gi", "volumeName": "dshm"}
        ]
        assert int(score["activeDeadlineSeconds"]) == 24 * 3600
    for name in spec["deploymentSpec"]["executors"]:
        secrets = executors[name]["secretAsEnv"]
        assert {e["envVar"] for s in secrets for e in s["keyToEnv"]} >= {
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
        }
        assert all(
            s["secretNameParameter"]["componentInputParameter"].endswith("s3_secret")
            for s in secrets
        )
    # The training task is a CPU-only launcher: no accelerator, no toleration; the GPUs and
    # nodes reach the PyTorchJob as parameters of the component.
    train = spec["deploymentSpec"]["executors"]["exec-train"]["container"]
    assert "accelerator" not in train["resources"] and "tolerations" not in executors["exec-train"]
    loop = next(
        c for c in spec["components"].values() if "train" in c.get("dag", {}).get("tasks", {})
    )
    task = loop["dag"]["tasks"]["train"]
    assert {"gpus_per_node", "nodes", "image", "job"} <= set(task["inputs"]["parameters"])
    assert task["retryPolicy"]["backoffMaxDuration"] == "1209600s"
    assert not task.get("cachingOptions", {}).get("enableCache")
    # No credential anywhere in the compiled spec.
    assert "AWS_SECRET_ACCESS_KEY:" not in out.read_text().replace("secretKey: AWS_SECRET", "")


def test_components_import_without_crosskd_torch_or_transformers():
    """Every component.py imports where crosskd, torch and transformers cannot be imported."""
    files = sorted(str(p) for p in (ROOT / "components").glob("*/component.py"))
    assert len(files) >= 9
    code = (
        "import importlib.util, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('crosskd', 'torch', 'transformers'):\n"
        "            raise ImportError(f'blocked: {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"for f in {files!r}:\n"
        "    name = 'components.' + f.split('/')[-2] + '.component'\n"
        "    __import__(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('crosskd', 'torch', 'transformers')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def tiny_run(s3, tmp_path_factory):
    """The tiny preset through the whole pipeline, everything on S3 (moto); KFP's own files in a
    local folder kept across the runs of this module."""
    local_root = tmp_path_factory.mktemp("kfp-local")
    config = load_run_config(
        None,
        "tiny",
        [
            "output=s3://crosskd-test/pipeline",
            "train.steps=4",
            "shard_rows=2",
            "score_pods=2",
            "ood_data=machine:licences",
            "ood_bytes=3000",
        ],
    )
    return {"arguments": preset_arguments(config), "local_root": str(local_root)}


def _run(tiny_run, capfd, caplog, **changes):
    """Run the pipeline; returns its result and the pure steps that hit KFP's cache: kfp.local
    logs "Task NAME cache hit" for them, and an executed task leaves its folder (with
    ``executor_output.json``) in the run's folder under the local root, a cache hit none; the
    two must agree. (kfp.local logs a task's own lines through a handler of its own, to the
    terminal, and the cache hits on the root logger, so at INFO both are read.)"""
    import logging
    import re

    root = Path(tiny_run["local_root"])
    before = set(root.glob("crosskd-distill-*"))
    capfd.readouterr()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        result = run_local({**tiny_run["arguments"], **changes}, local_root=str(root))
    log = re.sub(r"\x1b\[[0-9;]*m", "", "".join(capfd.readouterr()) + caplog.text)
    (run,) = set(root.glob("crosskd-distill-*")) - before
    executed = {p.parent.name for p in run.rglob("executor_output.json")}
    logged = {re.sub(r"-\d+$", "", m) for m in re.findall(r"Task ([\w-]+) cache hit", log)}
    assert logged == set(PURE) - executed, log[-3000:]
    return result, logged


def test_tiny_preset_runs_the_whole_pipeline_on_s3(tiny_run, s3, capfd, caplog):
    result, hits = _run(tiny_run, capfd, caplog)
    assert not hits
    bpb = result["bits_per_byte"]
    assert set(bpb) == {"teacher", "student_init", "student_kd", "student_ce"}
    assert all(0 < v < 16 for v in bpb.values())
    report = result["report"]
    assert report.startswith("s3://crosskd-test/pipeline/runs/") and report.endswith(
        "/report/index.html"
    )
    page = s3.cat_file(report[len("s3://") :]).decode()
    assert "data:image/png;base64," in page and "student_kd" in page
    run = report[len("s3://") : -len("/report/index.html")]
    evaluation = json.loads(s3.cat_file(f"{run}/evaluation.json"))
    assert {n: m["bits_per_byte"] for n, m in evaluation["models"].items()} == bpb
    # The out-of-domain rows (the machine's licence texts) prepared, evaluated and reported.
    ood = json.loads(s3.cat_file(f"{run}/evaluation_ood.json"))
    assert {n: m["bits_per_byte"] for n, m in ood["models"].items()} == result["ood_bits_per_byte"]
    assert set(result["ood_bits_per_byte"]) == set(bpb)
    assert ood["data"].endswith("/ood") and ood["data"] != evaluation["data"]
    assert "out-of-domain bits/byte" in page
    for variant in ("kd", "ce"):
        assert s3.exists(f"{run}/{variant}/final/model.safetensors")
        log = read_jsonl_log(f"s3://{run}/{variant}/metrics-rank0.jsonl")
        assert [r["step"] for r in log] == [1, 2, 3, 4]
    # Scoring was split over two pods' shard ranges and merged into one manifest per teacher.
    (cache,) = s3.ls("crosskd-test/pipeline/cache")
    parts = s3.ls(f"{cache}/parts")
    assert len(parts) == 2
    manifest = json.loads(s3.cat_file(f"{cache}/manifest.json"))
    assert [s["path"] for s in manifest["shards"]] == sorted(s["path"] for s in manifest["shards"])
    # Pure outputs sit under content-addressed prefixes of the root.
    assert {p.rsplit("/", 1)[-1] for p in s3.ls("crosskd-test/pipeline")} >= {
        "inputs",
        "tables",
        "prepared",
        "cache",
        "runs",
    }


def test_second_run_hits_the_cache_on_pure_steps_and_a_change_misses(tiny_run, capfd, caplog):
    _, hits = _run(tiny_run, capfd, caplog)
    assert hits == set(PURE)
    # k changes the teacher caches (and what follows), not the tables or the prepared data; the
    # runs train again, now as Trainer v2 TrainJobs (one parameter switches the cluster API).
    root = Path(tiny_run["local_root"])
    before = set(root.rglob("replicas/*"))
    result, hits = _run(tiny_run, capfd, caplog, k=8, job_kind="trainjob")
    assert {"init-student", "build-tables", "validate-tables", "build-projection"} <= hits
    assert {"prepare", "plan-tables"} <= hits
    assert "score-teacher" not in hits and "merge-cache" not in hits
    assert set(result["bits_per_byte"]) == {"teacher", "student_init", "student_kd", "student_ce"}
    replicas = set(root.rglob("replicas/*")) - before
    assert sorted(p.name for p in replicas) == ["node-0", "node-0"]  # kd and ce, one node each
    assert before and all(p.name == "master-0" for p in before)


def test_a_failing_step_fails_the_pipeline_with_its_own_message(tiny_run, capsys):
    from crosskd.cli import main

    code = main(
        [
            "pipeline",
            "run-local",
            "--preset",
            "tiny",
            "--local-root",
            tiny_run["local_root"],
            "--job-kind",
            "trainjob",
            "output=s3://crosskd-test/pipeline-bad",
            "teachers=[s3://crosskd-test/no-such-teacher]",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err.startswith("crosskd: error: step validate_inputs failed: ConfigError: teacher 0")
    assert "no-such-teacher" in err


@pytest.mark.parametrize("state, code", [("SUCCEEDED", 0), ("FAILED", 1)])
def test_cli_submits_the_committed_pipeline(state, code, monkeypatch, tmp_path, capsys):
    """``crosskd pipeline submit`` sends ``pipelines/distill.yaml`` with typed parameters and the
    bearer token from the environment to FakeKfpApi (a fake speaking the subset of the KFP
    v2beta1 REST API that kfp.Client uses), prints the run's URL and, with ``--wait``, exits
    non-zero when the run fails."""
    import kfp.client.client as kfp_client_module
    from kfp_fake import FakeKfpApi

    from crosskd.cli import main

    monkeypatch.setattr(
        kfp_client_module.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json")
    )
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("KFP_TOKEN", "t0ken-from-env")
    with FakeKfpApi() as fake:
        fake.run_states = ["RUNNING", state]
        fake.run_error = "train failed: JobFailed" if state == "FAILED" else None
        argv = [
            "pipeline",
            "submit",
            "--host",
            fake.host,
            "--namespace",
            "ml",
            "--wait",
            "--experiment",
            "crosskd-test",
            "steps=50",
            "teachers=[s3://b/qwen3]",
            "output_root=s3://b/out",
        ]
        assert main(argv) == code
        (created,) = fake.requests_to("POST", "/runs")
    out = capsys.readouterr().out
    assert f"{fake.host}/#/runs/details/" in out and state in out
    body = created.body
    # Both documents: the pipeline spec and the Kubernetes platform spec (GPUs, secrets, shm).
    spec, platform = yaml.safe_load_all((ROOT / COMPILED_FILE).read_text())
    assert body["pipeline_spec"] == {"pipeline_spec": spec, "platform_spec": platform}
    assert body["runtime_config"]["parameters"] == {
        "steps": 50,
        "teachers": ["s3://b/qwen3"],
        "output_root": "s3://b/out",
    }
    assert created.headers["authorization"] == "Bearer t0ken-from-env"
    assert "t0ken-from-env" not in out


def test_components_called_as_plain_functions(tmp_path):
    """The components' bodies called directly (``python_func``), outside KFP: the planners'
    self-contained items, and a same-tokenizer teacher's tables (none) passed through
    validation and the projection step (none) with pointer artifacts."""
    from kfp import dsl

    sys.path.insert(0, str(ROOT))
    from components.build_projection.component import build_projection
    from components.build_tables.component import build_tables
    from components.plan_scoring.component import plan_scoring
    from components.plan_tables.component import plan_tables
    from components.validate_tables.component import validate_tables

    teacher = {"index": 0, "ref": "m", "fingerprint": "f", "same_tokenizer": True}
    plan = {"root": str(tmp_path), "student": "s", "teachers": [teacher]}
    assert plan_tables.python_func(plan=plan) == [
        {"root": str(tmp_path), "student": "s", "teacher": teacher}
    ]
    prepared = {"train": "p/train", "train_shards": 5.0}  # KFP hands ints back as floats
    scoring = {"k": 16.0, "tau": 1.0, "encoding": "lossless", "token_budget": 1024.0}
    jobs = plan_scoring.python_func(plan=plan, prepared=prepared, scoring=scoring, score_pods=2)
    assert [(j["start"], j["stop"]) for j in jobs] == [(0, 2), (2, 5)]
    assert jobs[0]["scoring"]["k"] == 16 and isinstance(jobs[0]["scoring"]["k"], int)
    assert jobs[0]["data"] == "p/train" and jobs[0]["root"] == str(tmp_path)
    artifact = dsl.Artifact(uri=str(tmp_path / "tables"))
    item = {"root": str(tmp_path), "student": "s", "teacher": teacher}
    built = build_tables.python_func(item=item, tables=artifact)
    assert built == {"index": 0, "same_tokenizer": True, "sha256": {}}
    assert json.loads(Path(artifact.path).read_text()) == built
    figures = dsl.Metrics(uri=str(tmp_path / "figures"))
    checked = validate_tables.python_func(item=item, tables=built, figures=figures)
    assert checked == {**built, "validated": True}
    pointer = dsl.Artifact(uri=str(tmp_path / "projection"))
    assert build_projection.python_func(item=item, tables=checked, projection=pointer) == checked


def test_preset_arguments_for_a_local_run(monkeypatch):
    """A preset as pipeline arguments: the local executor, no GPU anywhere, every run key that is
    not a parameter of its own in ``options``, and the S3 Secret only when this machine has S3
    credentials (the local executor reads a Secret's keys from the environment)."""
    config = load_run_config(None, "scratch", ["output=out", "train.steps=7"])
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    arguments = preset_arguments(config)
    assert arguments["s3_secret"] == ""
    assert (arguments["executor"], arguments["gpus_per_node"], arguments["score_gpus"]) == (
        "local",
        0,
        0,
    )
    assert arguments["output_root"] == "out" and arguments["steps"] == 7
    assert arguments["metrics_port"] == 0  # a free port: 9400 may be taken on this machine
    assert arguments["teachers"] == ["zoo:smollm2"] and "steps" not in arguments["options"]
    # train.steps is the pipeline's own ``steps``; the other training keys stay in options.
    assert arguments["options"]["train"] == {
        "micro_batch_rows": 4,
        "lr": 0.003,
        "warmup_steps": 10,
        "loss": {"dynamic_kd_scale": True, "divergence": "forward_kl", "mismatch_weight": 5.0},
    }
    unset = load_run_config(None, None, ["output=out"])
    assert preset_arguments(unset)["steps"] == 100  # TrainConfig's default, not the pipeline's
    assert arguments["options"]["student_tokenizer"] == "zoo:llama3"
    assert "device" not in arguments["options"]  # None is left out: KFP carries no nulls
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    assert preset_arguments(config)["s3_secret"] == "crosskd-s3"

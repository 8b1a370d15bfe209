"""The commands of ``docs/kubernetes.md`` run as written: section 2 ("Try it on one machine")
in a fresh folder with its YAML file, through the local executor; of section 1, every
``crosskd`` command: ``crosskd job manifests`` on a copy of ``manifests/`` (nothing stale) and
``crosskd job submit`` against FakeKubernetesApi (``tests/k8s_fake.py``, a fake speaking the
subset of the Kubernetes REST API the launcher uses), which the real client reaches through a
kube-config. ``kubectl`` and ``docker`` lines need a real API server or engine and are not run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import doc_commands as doc
import yaml
from k8s_fake import PYTORCHJOB, TRAINJOB, FakeKubernetesApi, JobResource

from crosskd.k8s.job import job_name

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "kubernetes.md"


def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _crosskd_commands(title: str) -> list[str]:
    """The ``crosskd`` commands of the sh blocks of the section ``title``, in order."""
    blocks = doc.blocks(_section(title), "sh")
    return [c for _, b in blocks for c in doc.commands(b) if c.startswith("crosskd ")]


def test_section_2_runs_as_written(tmp_path):
    section = _section("2. Try it on one machine")
    for before, text in doc.blocks(section, "yaml"):
        names = re.findall(r"`([\w.-]+\.yaml)`", before)
        assert names, before
        (tmp_path / names[-1]).write_text(text)
    assert {"job-local.yaml"} <= {p.name for p in tmp_path.iterdir()}
    commands = [c for _, b in doc.blocks(section, "sh") for c in doc.commands(b)]
    assert [c.split()[:3] for c in commands] == [
        ["crosskd", "distill", "--preset"],
        ["crosskd", "job", "render"],
        ["crosskd", "job", "run-local"],
        ["crosskd", "job", "submit"],
        ["crosskd", "job", "submit"],
    ]
    outputs = [doc.run(c, tmp_path, doc.env()).stdout for c in commands]
    # The job trained the train config's steps, both replicas, and the final model is there.
    records = [
        json.loads(x)
        for x in (tmp_path / "tiny/job-run/metrics-rank0.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert (tmp_path / "tiny/job-run/final/config.json").is_file()
    assert "rank 1 serves /metrics" in (tmp_path / "local-job/worker-0/log.txt").read_text()
    assert "succeeded locally" in outputs[2]
    # The launcher's local mode found the finished run: it succeeds at once, nothing retrained.
    assert "succeeded" in outputs[3]
    # ... and so did the same job as a TrainJob on its runtime, as two nodes.
    assert outputs[4].startswith("TrainJob local/") and "succeeded" in outputs[4]
    assert {p.name for p in (tmp_path / "local-trainjob").iterdir()} == {"node-0", "node-1"}
    assert len((tmp_path / "tiny/job-run/metrics-rank0.jsonl").read_text().splitlines()) == 8


def test_section_1_crosskd_commands_run_as_written(tmp_path):
    manifests, submit = _crosskd_commands("1. From an empty namespace to a finished job")
    assert manifests == "crosskd job manifests"
    tree = tmp_path / "repo"
    shutil.copytree(ROOT / "manifests", tree / "manifests")
    before = {p: p.read_bytes() for p in (tree / "manifests").rglob("*") if p.is_file()}
    doc.run(manifests, tree, doc.env())
    assert {p: p.read_bytes() for p in before} == before  # the committed files are fresh

    assert submit.startswith("crosskd job submit --config job.yaml --namespace ml")
    shutil.copy(ROOT / "manifests" / "job.yaml", tree / "job.yaml")
    done = _submit_to_fake(submit, tree, tmp_path, PYTORCHJOB)
    name = job_name(yaml.safe_load((tree / "job.yaml").read_text())["run_id"])
    assert f"PyTorchJob ml/{name} succeeded" in done.stdout
    assert STEP in done.stderr  # the Master's log, streamed
    kept = yaml.safe_load((tree / "submitted.yaml").read_text())
    assert kept["kind"] == "PyTorchJob" and kept["metadata"]["namespace"] == "ml"


def _submit_to_fake(
    command: str, tree: Path, tmp_path: Path, kind: JobResource
) -> subprocess.CompletedProcess:
    """Run the ``crosskd job submit`` ``command`` in ``tree`` (its ``job.yaml``) against
    FakeKubernetesApi serving ``kind`` in namespace ``ml``, through a kube-config: rank 0 logs
    a step, then the job succeeds. Returns the finished command."""
    name = job_name(yaml.safe_load((tree / "job.yaml").read_text())["run_id"])
    with FakeKubernetesApi(job=kind) as fake:
        pods: list[str] = []
        fake.on_get("ml", name, 1, lambda f: pods.append(f.start_master("ml", name, [STEP])))

        def finish(f: FakeKubernetesApi) -> None:
            f.finish_master("ml", pods[0])
            f.set_condition("ml", name, kind.final[0])

        fake.on_get("ml", name, 2, finish)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
                    "users": [{"name": "fake", "user": {"token": "not-a-secret"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                }
            )
        )
        done = doc.run(command, tree, doc.env(KUBECONFIG=str(kubeconfig)))
        assert fake.errors == []
        assert fake.count("POST", fake.job_path("ml")) == 1
    return done


STEP = "step 1/1000 loss 10.1"


def test_section_8_crosskd_commands_run_as_written(tmp_path):
    render, submit = _crosskd_commands("8. Kubeflow Trainer v2: the same run as a TrainJob")
    assert render == "crosskd job render --config manifests/job.yaml --kind trainjob"
    rendered = yaml.safe_load(doc.run(render, ROOT, doc.env()).stdout)
    assert rendered["kind"] == "TrainJob" and rendered["spec"]["runtimeRef"]["name"]
    assert submit.startswith("crosskd job submit --config job.yaml --namespace ml --kind trainjob")
    tree = tmp_path / "repo"
    tree.mkdir()
    shutil.copy(ROOT / "manifests" / "job.yaml", tree / "job.yaml")
    done = _submit_to_fake(submit, tree, tmp_path, TRAINJOB)
    name = job_name(yaml.safe_load((tree / "job.yaml").read_text())["run_id"])
    assert f"TrainJob ml/{name} succeeded" in done.stdout
    assert STEP in done.stderr  # node 0's log, streamed

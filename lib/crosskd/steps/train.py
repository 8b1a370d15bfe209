"""Steps ``plan_training`` and ``train``: the training runs of a run (``kd``: CSD; ``ce``: CE
only on the same budget) and running one, in this process, as a PyTorchJob or TrainJob on the
cluster (the launcher: create or reattach, wait, stream rank 0's log) or through the local
executor that runs a rendered job the way the Training Operator (or the Trainer) would."""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any

import fsspec
import yaml

from crosskd.errors import ConfigError
from crosskd.metrics import read_jsonl_log
from crosskd.steps.config import EXECUTORS, RunConfig
from crosskd.steps.inputs import variants
from crosskd.train import TrainConfig, Trainer, finished_model

log = logging.getLogger(__name__)

TRAIN_FILE = "train.yaml"


def plan_training(
    config: RunConfig,
    plan: dict[str, Any],
    prepared: dict[str, Any],
    tables: list[dict[str, Any]],
    caches: list[dict[str, Any]],
    run_dir: str,
) -> list[dict[str, Any]]:
    """One item per training run (:func:`crosskd.steps.inputs.variants`): ``{"variant",
    "train": crosskd train keys}`` with the output ``<run_dir>/<variant>``; ``tables`` and
    ``caches`` (any order) are matched to teachers by their ``index``. Each of ``caches`` gives
    its teacher's ``cache`` URI (:func:`crosskd.steps.merge_caches`), the ``server`` URL of a
    teacher server (:func:`crosskd.steps.serve.start_teacher_servers`) or an ``online:REF``
    teacher (:func:`crosskd.steps.online_teachers`), the run's ``teachers`` entry."""
    by_index = {int(t["index"]): t for t in tables}
    cache_of = {int(c["index"]): _source(c) for c in caches}
    n = len(plan["teachers"])
    if sorted(by_index) != list(range(n)) or sorted(cache_of) != list(range(n)):
        raise ConfigError(
            f"plan_training: tables for teachers {sorted(by_index)} and caches for "
            f"{sorted(cache_of)}; every one of the {n} teachers needs both."
        )
    items = []
    for variant in variants(config):
        values = config.train_values(
            student=plan["student"],
            data=prepared["train"],
            output=f"{run_dir.rstrip('/')}/{variant}",
            caches=[cache_of[i] for i in range(n)],
            tables=[None if by_index[i]["same_tokenizer"] else by_index[i] for i in range(n)],
            kd=variant == "kd",
            train_rows=prepared.get("train_rows", "-"),
        )
        items.append({"variant": variant, "train": values})
    return items


def _source(entry: dict[str, Any]) -> str:
    """The ``teachers`` entry of one of :func:`plan_training`'s ``caches``."""
    for key in ("server", "online", "cache"):
        if key in entry:
            return entry[key]
    raise ConfigError(
        f"plan_training: teacher entry {entry!r} has none of server, online, cache; pass the "
        f"output of merge_caches, start_teacher_servers or online_teachers."
    )


def train(
    item: dict[str, Any],
    *,
    executor: str = "inprocess",
    job: dict[str, Any] | None = None,
    job_kind: str = "pytorchjob",
    run_id: str | None = None,
    workdir: str | None = None,
    wait_timeout: float | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the training item of :func:`plan_training` with ``executor``
    (:data:`crosskd.steps.config.EXECUTORS`); ``job`` (JobConfig keys), ``job_kind`` (the
    cluster API: :data:`crosskd.k8s.JOB_KINDS`) and ``run_id`` (the job's name derives from it,
    so a retried launcher reattaches) for ``local`` and ``cluster``;
    ``workdir``: the local executor's replica folders. The train config is written to
    ``<output>/train.yaml`` first. Returns ``{"variant", "output", "model", "steps", "last"}``
    (``last``: rank 0's metrics of the last step; the whole curve stays in the run's
    ``metrics-rank0.jsonl``, :func:`run_history`). A finished run returns at once; an
    interrupted one resumes from its checkpoint."""
    if executor not in EXECUTORS:
        raise ConfigError(f"executor is {executor!r}; choose one of {', '.join(EXECUTORS)}.")
    values = item["train"]
    config = TrainConfig(**values)
    output = values["output"].rstrip("/")
    fs, path = fsspec.core.url_to_fs(output)
    fs.makedirs(path, exist_ok=True)
    config_uri = f"{output}/{TRAIN_FILE}"
    fs.pipe_file(f"{path}/{TRAIN_FILE}", yaml.safe_dump(values, sort_keys=False).encode())
    if finished_model(config) is not None:
        log.info("training run %s is complete: nothing to do", output)
    elif executor == "inprocess":
        _train_here(config, progress)
    else:
        if not run_id:
            raise ConfigError("a training job needs a run id (its name derives from it).")
        documents = job_documents(
            config_uri, _local_ports(job or {}, executor), run_id, values.get("parallel"), job_kind
        )
        _train_as_job(documents, executor, job or {}, workdir, wait_timeout)
    history = run_history(output)
    return {
        "variant": item["variant"],
        "output": output,
        "model": f"{output}/final",
        "steps": config.steps,
        "last": history[-1] if history else {},
    }


def job_run_id(task_name: str, variant: str, pipeline_job_id: str) -> str:
    """The run id of a training run launched by a pipeline task (the job's name derives from
    it): ``<task>-<variant>-<pipeline job id>``, the same on every retry of the task so
    that a retried launcher reattaches to its job; past 63 characters (a Kubernetes name's
    limit) its first 50 and the first 12 hex digits of its sha256."""
    run_id = f"{task_name}-{variant}-{pipeline_job_id}"
    if len(run_id) > 63:
        run_id = f"{run_id[:50]}-{hashlib.sha256(run_id.encode()).hexdigest()[:12]}"
    return run_id


def run_history(output: str) -> list[dict[str, Any]]:
    """The per-step metrics of rank 0 of the run at ``output`` (the last record of each step,
    so an invocation resumed after a crash counts each step once), in step order."""
    records = read_jsonl_log(f"{output}/metrics-rank0.jsonl")
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def job_documents(
    config_uri: str,
    job: dict[str, Any],
    run_id: str,
    parallel: dict[str, Any] | None = None,
    job_kind: str = "pytorchjob",
) -> list[dict[str, Any]]:
    """The job of one training run, first, and what else it needs in its namespace (a
    TrainJob's TrainingRuntime): the JobConfig keys ``job`` with ``run_id`` and the train
    config read from ``config_uri`` (whose ``parallel`` layout must fit the job's workers), as
    a ``job_kind`` (:data:`crosskd.k8s.JOB_KINDS`). A job that asks for GPUs (``gpus_per_node``)
    but whose rendered pods request none is refused."""
    # lazy: crosskd.k8s imports the kubernetes and kubeflow clients (~0.4 s); every pipeline step
    # imports this module through crosskd.steps, and only rendering or running a job needs them
    from crosskd.k8s.job import job_layout, load_job_config
    from crosskd.k8s.kinds import KINDS

    if job_kind not in KINDS:
        raise ConfigError(f"job_kind is {job_kind!r}; choose one of {', '.join(KINDS)}.")
    config = load_job_config(values={**job, "run_id": run_id, "train_config_uri": config_uri})
    job_layout(config, parallel)
    manifest = KINDS[job_kind].render(config)
    if config.gpus_per_node:
        limits = _gpu_limits(manifest, config.gpu_resource)
        if any(limit != str(config.gpus_per_node) for limit in limits):
            raise ConfigError(
                f"gpus_per_node is {config.gpus_per_node} but the rendered job "
                f"requests {limits} {config.gpu_resource}; fix the job "
                f"config."
            )
    return [manifest, *KINDS[job_kind].support()]


def _gpu_limits(manifest: dict[str, Any], resource: str) -> list[str | None]:
    """The ``resource`` limit of each container of the rendered job (a TrainJob: of each
    node)."""
    if manifest["kind"] == "TrainJob":
        limits = manifest["spec"]["trainer"].get("resourcesPerNode", {}).get("limits", {})
        return [limits.get(resource)]
    return [
        c.get("resources", {}).get("limits", {}).get(resource)
        for s in manifest["spec"]["pytorchReplicaSpecs"].values()
        for c in s["template"]["spec"]["containers"]
    ]


def _train_here(config: Any, progress: bool) -> None:
    trainer = Trainer(config, progress=progress)
    try:
        trainer.setup()
        trainer.train()
        trainer.save()
    finally:
        trainer.close()


def _local_ports(job: dict[str, Any], executor: str) -> dict[str, Any]:
    """``job`` for ``executor``: several local jobs may run at once, so a local job's trainers
    serve ``/metrics`` on any free port."""
    if executor != "local":
        return job
    return {**job, "train_overrides": [*job.get("train_overrides", []), "metrics_port=0"]}


def _train_as_job(
    documents: list[dict[str, Any]],
    executor: str,
    job: dict[str, Any],
    workdir: str | None,
    wait_timeout: float | None,
) -> None:
    """Run the job of :func:`job_documents` on this machine (``local``) or submit it to the
    cluster and wait for it (``cluster``)."""
    if executor == "local":
        # lazy: crosskd.k8s imports the kubernetes and kubeflow clients (~0.4 s); every pipeline
        # step imports this module through crosskd.steps, and only running a job needs them
        from crosskd.k8s.local import run_local_job

        folder = Path(workdir or "crosskd-local-job")
        result = run_local_job(documents, folder, wait_timeout=wait_timeout)
    else:
        # lazy: crosskd.k8s imports the kubernetes and kubeflow clients (~0.4 s); every pipeline
        # step imports this module through crosskd.steps, and only submitting a job needs them
        from crosskd.k8s.cli import current_namespace
        from crosskd.k8s.launcher import submit

        namespace = job.get("namespace") or current_namespace()
        result = submit(documents[0], namespace=namespace, wait_timeout=wait_timeout or math.inf)
    log.info(
        "%s %s/%s succeeded in %.0f s",
        documents[0]["kind"],
        result.namespace,
        result.name,
        result.elapsed_s,
    )

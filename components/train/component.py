"""KFP component ``train``: :func:`crosskd.steps.train` through the job launcher (a CPU-only
pod; the GPUs go to the PyTorchJob or TrainJob)."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def train(
    item: dict,
    executor: str,
    job_kind: str,
    image: str,
    gpus_per_node: int,
    nodes: int,
    job: dict,
    s3_secret: str,
    pipeline_job_id: str,
    task_name: str,
    model: dsl.Output[dsl.Model],
    figures: dsl.Output[dsl.Metrics],
) -> dict:
    """Train one run as a ``job_kind`` job (a PyTorchJob or a Trainer v2 TrainJob) named after
    the pipeline job and this task (so a retried launcher reattaches) and wait for it; its pods
    read S3 credentials from the Secret ``s3_secret`` (unless ``job`` names another; empty:
    none)."""
    from pathlib import Path

    from crosskd.steps import train
    from crosskd.steps.runtime import drop_none, from_kfp, start_step, write_pointer
    from crosskd.steps.train import job_run_id

    start_step("train")
    item = from_kfp(item)
    job = from_kfp(job)
    run_id = job_run_id(task_name, item["variant"], pipeline_job_id)
    settings = {**job, "image": image, "gpus_per_node": gpus_per_node, "nodes": nodes}
    if s3_secret:
        settings.setdefault("s3_secret", s3_secret)
    workdir = str(Path(figures.path).parent / "replicas")
    result = train(
        item,
        executor=executor,
        job=settings,
        job_kind=job_kind,
        run_id=run_id,
        workdir=workdir,
        progress=False,
    )
    model.metadata.update(
        write_pointer(
            model.path, result["model"], {"variant": result["variant"], "steps": result["steps"]}
        )
    )
    for key in ("loss", "ce", "kd"):
        if key in result["last"]:
            figures.log_metric(f"{result['variant']}_final_{key}", float(result["last"][key]))
    Path(figures.path).write_text(str(result["last"]))
    return drop_none(result)

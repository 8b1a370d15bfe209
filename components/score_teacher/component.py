"""KFP component ``score_teacher``: :func:`crosskd.steps.score_teacher` (the GPU step)."""

import os

from kfp import dsl

# The CUDA variant of the project image; crosskd pipeline compile --image sets it.
CUDA_IMAGE = os.environ.get(
    "CROSSKD_CUDA_IMAGE",
    os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0") + "-cuda",
)


@dsl.component(base_image=CUDA_IMAGE, install_kfp_package=False)
def score_teacher(job: dict, gpus: int, metrics_port: int, part: dsl.Output[dsl.Artifact]) -> dict:
    """Score one shard range of the prepared training data with one teacher into its
    content-addressed top-K cache, on the pod's GPUs (``gpus`` > 1: the teacher sharded over
    them, one process each), else on the CPU, serving the scoring metrics on ``metrics_port``
    (-1: not served)."""
    from crosskd.steps import score_teacher
    from crosskd.steps.runtime import drop_none, from_kfp, start_step, write_pointer

    start_step("score_teacher")
    job = from_kfp(job)
    if not gpus and not job["scoring"].get("device"):
        job["scoring"]["device"] = "cpu"
    scored = score_teacher(
        job,
        progress=False,
        processes=max(gpus, 1),
        metrics_port=None if metrics_port < 0 else metrics_port,
    )
    part.metadata.update(write_pointer(part.path, scored["cache"], scored))
    return drop_none(scored)

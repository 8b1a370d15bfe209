"""KFP component ``stop_teacher_server``: :func:`crosskd.steps.stop_teacher_servers`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def stop_teacher_server(teachers: list, job: dict, pipeline_job_id: str) -> list:
    """Delete the teacher servers of the pipeline job (one per entry of ``teachers``, the
    pipeline parameter: an exit task takes no other task's output); ones already gone are no
    error. Returns the names of those deleted."""
    from crosskd.steps import stop_teacher_servers
    from crosskd.steps.runtime import from_kfp, start_step

    start_step("stop_teacher_server")
    return stop_teacher_servers(len(teachers), pipeline_job_id, job=from_kfp(job))

"""KFP component ``start_teacher_server``: :func:`crosskd.steps.start_teacher_servers` (a
CPU-only pod; the GPUs go to the servers)."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def start_teacher_server(
    plan: dict,
    scoring: dict,
    server: dict,
    job: dict,
    executor: str,
    image: str,
    pipeline_job_id: str,
) -> list:
    """Bring up one teacher server per teacher, named after the pipeline job (so a retried
    task reattaches), in the training job's namespace, and wait until every replica is ready;
    returns per teacher ``{"index", "server", "name"}`` for ``plan_training``."""
    from crosskd.steps import start_teacher_servers
    from crosskd.steps.runtime import drop_none, from_kfp, start_step

    start_step("start_teacher_server")
    servers = start_teacher_servers(
        from_kfp(plan),
        from_kfp(scoring),
        from_kfp(server),
        from_kfp(job),
        pipeline_job_id,
        image=image,
        executor=executor,
    )
    return drop_none(servers)

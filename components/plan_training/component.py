"""KFP component ``plan_training``: :func:`crosskd.steps.plan_training`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def plan_training(
    run_config: dict, plan: dict, prepared: dict, tables: list, caches: list, run_id: str
) -> list:
    """The training runs (``kd``, and ``ce`` to compare) under the run's folder."""
    from crosskd.steps import RunConfig, plan_training, run_folder
    from crosskd.steps.runtime import drop_none, from_kfp, start_step

    start_step("plan_training")
    run_config = from_kfp(run_config)
    plan = from_kfp(plan)
    prepared = from_kfp(prepared)
    tables = from_kfp(tables)
    caches = from_kfp(caches)
    config = RunConfig(**run_config)
    folder = run_folder(plan["root"], run_id)
    return drop_none(plan_training(config, plan, prepared, tables, caches, folder))

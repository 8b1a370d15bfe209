"""KFP component ``plan_tables``: :func:`crosskd.steps.plan_tables`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def plan_tables(plan: dict) -> list:
    """One self-contained item per teacher (the fan-out of ``build_tables``)."""
    from crosskd.steps import plan_tables
    from crosskd.steps.runtime import drop_none, from_kfp, start_step

    start_step("plan_tables")
    return drop_none(plan_tables(from_kfp(plan)))

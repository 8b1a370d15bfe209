"""KFP component ``plan_scoring``: :func:`crosskd.steps.plan_scoring`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def plan_scoring(plan: dict, prepared: dict, scoring: dict, score_pods: int) -> list:
    """One self-contained scoring job per teacher and shard range (the fan-out of
    ``score_teacher``)."""
    from crosskd.steps import plan_scoring
    from crosskd.steps.runtime import drop_none, from_kfp, start_step

    start_step("plan_scoring")
    jobs = plan_scoring(from_kfp(plan), from_kfp(prepared), from_kfp(scoring), score_pods)
    return drop_none(jobs)

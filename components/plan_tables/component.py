"""KFP component ``plan_tables``: :func:`crosskd.steps.plan_tables`."""

from kfp import dsl

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def plan_tables(plan: dict) -> list:
    """One self-contained item per teacher (the fan-out of ``build_tables``)."""
    from crosskd.steps import plan_tables
    from crosskd.steps.runtime import drop_none, from_kfp, start_step

    start_step("plan_tables")
    return drop_none(plan_tables(from_kfp(plan)))

"""KFP component ``validate_tables``: :func:`crosskd.steps.validate_tables`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def validate_tables(item: dict, tables: dict, figures: dsl.Output[dsl.Metrics]) -> dict:
    """Fail on a table that breaks a rule of the spec; else pass the tables on."""
    from pathlib import Path

    from crosskd.steps import validate_tables
    from crosskd.steps.runtime import drop_none, from_kfp, start_step

    start_step("validate_tables")
    tables = from_kfp(tables)
    checked = validate_tables(from_kfp(item), tables)
    if checked["common_tokens"] is not None:
        figures.log_metric("common_tokens", checked["common_tokens"])
    Path(figures.path).parent.mkdir(parents=True, exist_ok=True)
    Path(figures.path).write_text(str(checked))
    return drop_none({**tables, "validated": True})

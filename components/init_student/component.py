"""KFP component ``init_student``: :func:`crosskd.steps.init_student`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def init_student(plan: dict, figures: dsl.Output[dsl.Metrics]) -> dict:
    """The plan with its student ready for training: as it is, or (``transplant`` set) with the
    student moved onto the run's student tokenizer and published under the run's root."""
    from pathlib import Path

    from crosskd.steps import init_student
    from crosskd.steps.runtime import drop_none, from_kfp, start_step

    start_step("init_student")
    resolved = init_student(from_kfp(plan))
    report = resolved.get("transplanted") or {}
    for key in ("vocab_size", "kept", "averaged", "fallback"):
        if key in report:
            figures.log_metric(f"transplant_{key}", report[key])
    for name, value in (report.get("bits_per_byte") or {}).items():
        figures.log_metric(f"transplant_{name}_bits_per_byte", value)
    Path(figures.path).parent.mkdir(parents=True, exist_ok=True)
    Path(figures.path).write_text(str(report))
    return drop_none(resolved)

"""KFP component ``report``: :func:`crosskd.steps.report`, shown in the KFP UI."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def report(
    plan: dict,
    evaluation: dict,
    runs: list,
    run_config: dict,
    run_id: str,
    page: dsl.Output[dsl.HTML],
    summary: dsl.Output[dsl.Markdown],
    folder: dsl.Output[dsl.Artifact],
) -> dict:
    """The report (bits-per-byte table, loss curves, configuration) as one self-contained HTML
    page and a Markdown summary."""
    from pathlib import Path

    import fsspec

    from crosskd.steps import report, run_folder
    from crosskd.steps.runtime import drop_none, from_kfp, start_step, write_pointer

    start_step("report")
    plan = from_kfp(plan)
    evaluation = from_kfp(evaluation)
    runs = from_kfp(runs)
    run_config = from_kfp(run_config)
    written = report(evaluation, runs, run_config, f"{run_folder(plan['root'], run_id)}/report")
    with fsspec.open(written["html"], "rb") as fh:
        Path(page.path).write_bytes(fh.read())
    Path(summary.path).write_text(written["markdown"], encoding="utf-8")
    folder.metadata.update(write_pointer(folder.path, written["uri"], {"html": written["html"]}))
    return drop_none(
        {
            "report": written["html"],
            "bits_per_byte": written["bits_per_byte"],
            "ood_bits_per_byte": written.get("ood_bits_per_byte"),
        }
    )

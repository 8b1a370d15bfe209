"""KFP component ``prepare``: :func:`crosskd.steps.prepare_data`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def prepare(
    plan: dict,
    preparing: dict,
    metrics_port: int,
    train: dsl.Output[dsl.Artifact],
    heldout: dsl.Output[dsl.Artifact],
    ood: dsl.Output[dsl.Artifact],
) -> dict:
    """Clip, align and lockstep-pack the training, held-out and out-of-domain rows
    (content-addressed), serving the rows prepared and clipped on ``metrics_port`` (-1: not
    served). ``ood`` points at nothing when the run has no out-of-domain rows."""
    from crosskd.steps import prepare_data
    from crosskd.steps.runtime import drop_none, from_kfp, start_step, write_pointer

    start_step("prepare")
    plan = from_kfp(plan)
    preparing = from_kfp(preparing)
    prepared = prepare_data(
        plan,
        max_length=int(preparing["max_length"]),
        shard_rows=int(preparing["shard_rows"]),
        pack=bool(preparing.get("pack", True)),
        workers=int(preparing.get("workers", 1)),
        progress=False,
        metrics_port=None if metrics_port < 0 else metrics_port,
    )
    for split, artifact in (("train", train), ("heldout", heldout), ("ood", ood)):
        artifact.metadata.update(
            write_pointer(
                artifact.path,
                prepared.get(split),
                {
                    "rows": prepared["rows"].get(split),
                    "data_fingerprint": prepared["data_fingerprint"].get(split),
                },
            )
        )
    return drop_none(prepared)

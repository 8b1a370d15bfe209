"""KFP component ``build_tables``: :func:`crosskd.steps.build_tables`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def build_tables(item: dict, tables: dsl.Output[dsl.Artifact]) -> dict:
    """The sub-token table pair of the student and one teacher (content-addressed; none for a
    same-tokenizer teacher)."""
    from crosskd.steps import build_tables
    from crosskd.steps.runtime import drop_none, from_kfp, start_step, write_pointer

    start_step("build_tables")
    built = build_tables(from_kfp(item), progress=False)
    tables.metadata.update(write_pointer(tables.path, built.get("uri"), built))
    return drop_none(built)

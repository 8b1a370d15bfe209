"""KFP component ``build_projection``: :func:`crosskd.steps.build_projection`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def build_projection(item: dict, tables: dict, projection: dsl.Output[dsl.Artifact]) -> dict:
    """X-Token's projection of the student and one teacher, built from its validated tables
    and validated (content-addressed; none for a same-tokenizer teacher); passes the tables
    on with it."""
    from crosskd.steps import build_projection
    from crosskd.steps.runtime import drop_none, from_kfp, start_step, write_pointer

    start_step("build_projection")
    built = build_projection(from_kfp(item), from_kfp(tables))
    projection.metadata.update(write_pointer(projection.path, built.get("projection"), built))
    return drop_none(built)

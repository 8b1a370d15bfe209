"""KFP component ``merge_cache``: :func:`crosskd.steps.merge_caches`."""

import os

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def merge_cache(parts: list, caches: dsl.Output[dsl.Artifact]) -> list:
    """Join the scored shard ranges into one cache manifest per teacher (the artifact lists
    every teacher's cache URI in its metadata)."""
    from crosskd.steps import merge_caches
    from crosskd.steps.runtime import drop_none, from_kfp, start_step, write_pointer

    start_step("merge_cache")
    parts = from_kfp(parts)
    merged = merge_caches(parts)
    caches.metadata.update(write_pointer(caches.path, None, {"caches": merged}))
    return drop_none(merged)

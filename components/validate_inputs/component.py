"""KFP component ``validate_inputs``: :func:`crosskd.steps.validate_inputs`."""

import os
from typing import NamedTuple

from kfp import dsl

# The project image (images/); crosskd pipeline compile --image sets CROSSKD_IMAGE.
IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def validate_inputs(
    output_root: str,
    teachers: list,
    student: str,
    train_data: str,
    heldout_data: str,
    ood_data: str,
    k: int,
    tau: float,
    steps: int,
    compare_ce_only: bool,
    score_pods: int,
    options: dict,
    executor: str,
    job_kind: str,
    image: str,
    gpus_per_node: int,
    nodes: int,
    job: dict,
    inputs: dsl.Output[dsl.Artifact],
) -> NamedTuple("Outputs", plan=dict, preparing=dict, scoring=dict, run_config=dict):
    """Check every input and setting in seconds and resolve references into URIs. ``plan``,
    ``preparing`` and ``scoring`` feed the pure steps (only what changes their outputs, so
    KFP's cache hits when anything else changes); ``run_config`` (every RunConfig key) feeds
    training, evaluation and the report."""
    from collections import namedtuple
    from dataclasses import asdict

    from crosskd.steps import run_config_from_parameters, validate_inputs
    from crosskd.steps.runtime import drop_none, from_kfp, start_step, write_pointer

    start_step("validate_inputs")
    teachers = from_kfp(teachers)
    options = from_kfp(options)
    job = from_kfp(job)
    parameters = {
        "output": output_root,
        "teachers": list(teachers),
        "student": student,
        "train_data": train_data,
        "heldout_data": heldout_data,
        "ood_data": ood_data,
        "k": k,
        "tau": tau,
        "train": {"steps": steps},
        "compare_ce_only": compare_ce_only,
        "score_pods": score_pods,
    }
    config = run_config_from_parameters(parameters, options)
    settings = {**job, "image": image, "gpus_per_node": gpus_per_node, "nodes": nodes}
    plan = validate_inputs(config, job=settings, executor=executor, job_kind=job_kind)
    inputs.metadata.update(write_pointer(inputs.path, plan["root"], {"plan": plan}))
    outputs = namedtuple("Outputs", ["plan", "preparing", "scoring", "run_config"])
    return outputs(*drop_none([plan, config.preparing(), config.scoring(), asdict(config)]))

"""KFP component ``evaluate``: :func:`crosskd.steps.evaluate_models`."""

import os

from kfp import dsl

# The CUDA variant of the project image; crosskd pipeline compile --image sets it.
CUDA_IMAGE = os.environ.get(
    "CROSSKD_CUDA_IMAGE",
    os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0") + "-cuda",
)


@dsl.component(base_image=CUDA_IMAGE, install_kfp_package=False)
def evaluate(
    plan: dict,
    prepared: dict,
    runs: list,
    run_id: str,
    scoring: dict,
    gpus: int,
    evaluation: dsl.Output[dsl.Artifact],
    figures: dsl.Output[dsl.Metrics],
) -> dict:
    """Held-out bits per byte (in domain and, with out-of-domain rows, out of domain) of the
    teachers and of the student before and after training, on the pod's GPU (``gpus`` > 0),
    else on the CPU."""
    from pathlib import Path

    from crosskd.steps import evaluate_run, models_to_evaluate, run_folder
    from crosskd.steps.runtime import drop_none, from_kfp, start_step, write_pointer

    start_step("evaluate")
    plan = from_kfp(plan)
    prepared = from_kfp(prepared)
    runs = from_kfp(runs)
    scoring = from_kfp(scoring)
    result = evaluate_run(
        prepared,
        models_to_evaluate(plan, runs),
        run_folder(plan["root"], run_id),
        token_budget=int(scoring["token_budget"]),
        device=scoring.get("device") if gpus else "cpu",
    )
    values = {key: result[key] for key in ("bits_per_byte", "ood_bits_per_byte") if key in result}
    for key, by_model in values.items():
        for name, value in by_model.items():
            figures.log_metric(f"{key}_{name}", float(value))
    Path(figures.path).write_text(str(values))
    evaluation.metadata.update(write_pointer(evaluation.path, result["uri"], values))
    return drop_none(result)

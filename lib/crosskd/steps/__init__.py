"""The steps of a distillation run, one function each: the only code that the KFP components
(``components/<step>/``), ``crosskd distill`` and ``crosskd pipeline run-local`` call.

validate_inputs -> init_student -> plan_tables -> per teacher: build_tables -> validate_tables
-> build_projection;
prepare_data -> plan_scoring -> score_teacher (per teacher and shard range) -> merge_caches ->
plan_training -> train (per variant) -> evaluate_run (in domain and out of domain) -> report; or,
with teacher servers instead of caches, start_teacher_servers -> plan_training -> train ->
stop_teacher_servers; or, with the teachers in the training process (``crosskd distill`` with
``teacher_scoring: online``), online_teachers -> plan_training.
The ``plan_*`` steps make self-contained items for the fan-outs (each item carries what its
step needs).

Each takes URIs and small JSON-able values and returns small JSON-able metadata (URIs,
fingerprints, sha256, counts); large data stay in storage. Each is idempotent: on complete
outputs it returns at once, on partial ones it resumes. The pure steps (tables, prepare,
scoring) write under content-addressed prefixes of the run's root (:func:`content_uri`), so the
same inputs give the same URIs, run after run.
"""

from crosskd.steps.config import (
    RunConfig,
    load_run_config,
    preset_values,
    run_config_from_parameters,
)
from crosskd.steps.evaluate import evaluate_models, evaluate_run, models_to_evaluate, report
from crosskd.steps.inputs import validate_inputs
from crosskd.steps.locations import content_uri, run_folder
from crosskd.steps.prepare import prepare_data
from crosskd.steps.projection import build_projection
from crosskd.steps.score import merge_caches, online_teachers, plan_scoring, score_teacher
from crosskd.steps.serve import start_teacher_servers, stop_teacher_servers
from crosskd.steps.student import init_student
from crosskd.steps.tables import build_tables, plan_tables, validate_tables
from crosskd.steps.train import plan_training, train

__all__ = [
    "RunConfig",
    "build_projection",
    "build_tables",
    "content_uri",
    "evaluate_models",
    "evaluate_run",
    "init_student",
    "load_run_config",
    "merge_caches",
    "models_to_evaluate",
    "online_teachers",
    "plan_scoring",
    "plan_tables",
    "plan_training",
    "prepare_data",
    "preset_values",
    "report",
    "run_config_from_parameters",
    "run_folder",
    "score_teacher",
    "start_teacher_servers",
    "stop_teacher_servers",
    "train",
    "validate_inputs",
    "validate_tables",
]

"""Step ``init_student``: the run's student, moved onto ``student_tokenizer`` first when the run
asks for tokenizer transfer (``RunConfig.transplant``): the pretrained student with new
embeddings made from its old ones (:mod:`crosskd.transplant`), published once under the
content-addressed URI :func:`crosskd.steps.inputs.validate_inputs` planned."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from crosskd.steps.locations import materialize, read_json

log = logging.getLogger(__name__)

REPORT = "transplant.json"
"""The transplant's report (:class:`crosskd.transplant.TransplantReport`), written beside the
moved student's weights."""


def init_student(plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (of :func:`crosskd.steps.inputs.validate_inputs`) with its student ready for
    training: without ``plan["transplant"]`` the plan as it is; with it, ``plan["student"]``
    becomes the moved student's URI (``plan["transplant"]["output"]``, written unless a complete
    one is there) and ``plan["transplanted"]`` its report: ``{"vocab_size", "kept",
    "averaged", "fallback", "tied", "bits_per_byte"}`` (row counts of the new embedding;
    held-out bits per byte before training when ``transplant.heldout`` is set)."""
    spec = plan.get("transplant")
    if not spec:
        return plan
    # lazy: crosskd.transplant imports transformers (~1 s) to load the model; every pipeline
    # step imports crosskd.steps, and only this step moves a model
    from crosskd.transplant import TransplantConfig, transplant

    values = {key: value for key, value in spec.items() if key != "output"}
    uri = spec["output"]

    def build(folder: Path) -> None:
        report = transplant(TransplantConfig(**values, output=str(folder)))
        record = {key: value for key, value in asdict(report).items() if key != "output"}
        (folder / REPORT).write_text(json.dumps(record, indent=1), encoding="utf-8")

    materialize(uri, build)
    report = read_json(f"{uri.rstrip('/')}/{REPORT}")
    log.info("student %s moved onto %s: %s", spec["model"], spec["tokenizer"], uri)
    return {**plan, "student": uri, "transplanted": report}

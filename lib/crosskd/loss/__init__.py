"""The student's loss (spec sections 5 and 6).

* :mod:`.config`: :class:`LossConfig` (every option, checked with errors naming the key);
* :mod:`.events` / :mod:`.tokens`: the events of every counted chunk (cross-tokenizer) or
  position (same tokenizer), built once per batch in numpy;
* :mod:`.divergence`: divergences over events + REST;
* :mod:`.logprobs`: the student log-prob interface the sharded versions implement;
* :mod:`.csd`: one KD term from events (gathers and segment sums);
* :mod:`.teachers`: bits per byte and selection, mixtures of teachers;
* :mod:`.metrics`: per-teacher, per-shape metric sums and their summary;
* :mod:`.objective`: :func:`plan_loss` (data side) and :func:`compute_loss` (CE + kd_scale * KD).
"""

from crosskd.loss.config import LossConfig, TeacherLossConfig, check_teachers
from crosskd.loss.csd import KdTerm, csd_kd, kd_from_events
from crosskd.loss.divergence import DIVERGENCES, divergence, with_rest
from crosskd.loss.events import CsdOptions, Events, build_events
from crosskd.loss.logprobs import LocalLogProbs, StudentLogProbs, segment_sum
from crosskd.loss.objective import (
    LossOutput,
    LossPlan,
    StepCounts,
    TeacherBatch,
    compute_loss,
    kd_scale,
    plan_loss,
)

__all__ = [
    "DIVERGENCES",
    "CsdOptions",
    "Events",
    "KdTerm",
    "LocalLogProbs",
    "LossConfig",
    "LossOutput",
    "LossPlan",
    "StepCounts",
    "StudentLogProbs",
    "TeacherBatch",
    "TeacherLossConfig",
    "build_events",
    "check_teachers",
    "compute_loss",
    "csd_kd",
    "divergence",
    "kd_from_events",
    "kd_scale",
    "plan_loss",
    "segment_sum",
    "with_rest",
]

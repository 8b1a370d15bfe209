"""The CSD loss (spec section 5): events per chunk (:mod:`.events`), divergences over events +
REST (:mod:`.divergence`), the student log-prob interface the shard-parallel versions implement
(:mod:`.logprobs`), and the single-teacher KD term (:mod:`.csd`)."""

from crosskd.loss.csd import csd_kd, kd_from_events
from crosskd.loss.divergence import DIVERGENCES, divergence, with_rest
from crosskd.loss.events import CsdOptions, Events, build_events
from crosskd.loss.logprobs import LocalLogProbs, StudentLogProbs, segment_sum

__all__ = [
    "DIVERGENCES", "CsdOptions", "Events", "LocalLogProbs", "StudentLogProbs", "build_events",
    "csd_kd", "divergence", "kd_from_events", "segment_sum", "with_rest",
]  # fmt: skip

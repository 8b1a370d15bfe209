"""The CSD loss (spec section 5): divergences over events + REST, chunk by chunk, and the
student log-prob interface the shard-parallel versions implement."""

from crosskd.loss.divergence import DIVERGENCES, divergence, with_rest
from crosskd.loss.logprobs import LocalLogProbs, StudentLogProbs, segment_sum

__all__ = [
    "DIVERGENCES", "LocalLogProbs", "StudentLogProbs", "divergence", "segment_sum", "with_rest",
]  # fmt: skip

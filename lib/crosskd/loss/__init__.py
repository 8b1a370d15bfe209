"""The CSD loss (spec section 5): divergences over events + REST, chunk by chunk."""

from crosskd.loss.divergence import DIVERGENCES, divergence, with_rest

__all__ = ["DIVERGENCES", "divergence", "with_rest"]

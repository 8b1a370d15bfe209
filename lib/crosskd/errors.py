"""The exceptions crosskd raises for bad input.

Every message names the input, what is wrong with it and what to do. The CLI turns any
:class:`CrosskdError` into one line on stderr and its ``exit_code`` (2; 3 for a non-finite loss)
and :class:`Stopped` into 143 (the table of :mod:`crosskd.train.launch`); anything else is a bug
or a transient failure (a lost peer, a timeout) and keeps its traceback.
"""


class CrosskdError(ValueError):
    """Bad input or a broken artifact; the message says which and what to do."""

    exit_code = 2


class Stopped(Exception):
    """SIGTERM stopped a training run after a step, which was checkpointed (retryable)."""

    exit_code = 143


class TokenizerError(CrosskdError):
    """A tokenizer cannot be found, is not supported, or does not match what an artifact needs."""


class TableError(CrosskdError):
    """A sub-token table file is missing, malformed, or does not belong to the tokenizers given."""


class DataError(CrosskdError):
    """A dataset row is malformed, or a sample cannot be clipped or packed as asked."""


class ConfigError(CrosskdError):
    """A configuration value is missing, out of range, or inconsistent with the inputs given."""

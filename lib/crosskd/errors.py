"""The exceptions crosskd raises for bad input, and those of training that several layers
share (the trainer raises them, the training pod's entry point maps them to exit codes).

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


class TrainingError(CrosskdError):
    """Training cannot go on (inputs that do not fit together, a non-finite loss)."""


class NonFiniteLoss(TrainingError):
    """A NaN or infinite loss term stopped the run before the optimizer step."""

    exit_code = 3


class InputError(TrainingError):
    """A rank's inputs of a step are bad (a damaged shard, a teacher cache that does not match
    the data): every rank stops with the same error, and the pod is not retried."""


class PeerFailed(RuntimeError):
    """Another rank failed (its own error says why); not classified here, so the rank with
    the real error decides the pod's exit code (:mod:`crosskd.train.launch`)."""


class InputFailed(RuntimeError):
    """A rank could not read its inputs of a step for a reason that may pass (object storage
    that failed): every rank stops with the same error, and the pod is retried."""

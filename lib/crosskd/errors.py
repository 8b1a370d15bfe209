"""The exceptions crosskd raises for bad input.

Every message names the input, what is wrong with it and what to do. The CLI turns any
:class:`CrosskdError` into one line on stderr and exit status 2; anything else is a bug.
"""


class CrosskdError(ValueError):
    """Bad input or a broken artifact; the message says which and what to do."""


class TokenizerError(CrosskdError):
    """A tokenizer cannot be found, is not supported, or does not match what an artifact needs."""


class TableError(CrosskdError):
    """A sub-token table file is missing, malformed, or does not belong to the tokenizers given."""


class DataError(CrosskdError):
    """A dataset row is malformed, or a sample cannot be clipped or packed as asked."""


class ConfigError(CrosskdError):
    """A configuration value is missing, out of range, or inconsistent with the inputs given."""

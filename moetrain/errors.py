"""User-facing errors.

A `ConfigError` (or any `MoetrainError`) means the user asked for something we cannot do: the
command line prints its message as one paragraph and exits non-zero, without a traceback
(unless `--debug`). Everything else is a bug and keeps its traceback.
"""


class MoetrainError(Exception):
    """A mistake the user can fix. The message names the file/field/value and the fix."""


class ConfigError(MoetrainError):
    """A configuration value, key or file that is wrong."""


class DataError(MoetrainError):
    """A data file that is missing, empty, truncated or inconsistent with its metadata."""


class CheckpointError(MoetrainError):
    """A checkpoint that is missing, incomplete or does not match the model."""

"""The project's error policy: problems that are the user's to fix (a bad config value, a flag, a
file, a busy run directory, a missing extra) are `UserError`s, which the command line prints as one
line. Every other exception, torch's and Python's included, is a bug or a system failure and keeps
its traceback (with FASTTRAIN_DEBUG=1 every error does).

Each subclass also derives from the built-in type a Python caller would expect (a bad value is a
`ValueError`, a missing checkpoint a `FileNotFoundError`, ...), so code that catches those keeps
working; the CLI catches `UserError` only.
"""


class UserError(Exception):
    """A problem with what the user asked for, explained in one line."""


class InvalidInput(UserError, ValueError):
    """A value the user gave (a config key, a flag, an argument) that cannot be used."""


class ConfigError(InvalidInput):
    """A bad configuration key or value; the message names the key."""


class CheckpointError(InvalidInput):
    """An unreadable, malformed, unsafe or unfitting checkpoint; the message names the path."""


class DataError(InvalidInput):
    """A data folder or file that cannot be trained on; the message names the file."""


class RunDirError(UserError, RuntimeError):
    """A run directory in use by another process, or holding a run a fresh start would overwrite."""


class MissingFile(UserError, FileNotFoundError):
    """A file or folder the command needs is not there."""


class MissingDependency(UserError, ImportError):
    """An optional package the request needs is not installed (the message names the extra)."""


class NonFiniteStop(UserError, FloatingPointError):
    """Training stopped because its steps stopped being finite (the message says what was kept)."""


class DeviceError(UserError, RuntimeError):
    """A device or process layout that this request cannot use (no CUDA, no process group)."""


class WriteError(UserError, OSError):
    """An output that cannot be written (no space left, no permission, a read-only folder or disk); the
    message names the path and says that nothing half-written was left."""

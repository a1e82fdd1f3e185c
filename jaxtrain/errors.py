"""Bad user input: the errors the command line prints as one line without a traceback, and its exit codes."""

from __future__ import annotations

# A checkpoint that could not be written (checkpoint.on_failure=stop, or the final save): EX_IOERR from
# sysexits.h, so a wrapper can tell storage trouble (fix the disk, rerun: it resumes) from bad input (exit 2). The
# command line returns it, and so does every process of a job whose save failed elsewhere (save_failure.py).
CHECKPOINT_WRITE_FAILED_EXIT = 74

# The Ray engine lost processes it could not replace (`jaxtrain.asynchronous.engine.ProcessesLost`): EX_TEMPFAIL from
# sysexits.h, a failure that a rerun may not meet, so a restarting launcher restarts it (it resumes from the newest
# checkpoint), unlike bad input (exit 2).
PROCESSES_LOST_EXIT = 75


class UserInputError(ValueError):
    """A configuration, mesh, rule, data source or checkpoint that cannot work, with a message saying how to fix it."""


class ConfigError(UserInputError):
    """A config key that names no field, or a value of the wrong type, out of range or not among the choices."""

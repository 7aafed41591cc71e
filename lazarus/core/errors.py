"""Typed errors. A UserError is a mistake in what a person gave us (flags, job file, checkpoint
path): the CLI prints its message as one line and exits non-zero, never a traceback."""


class UserError(ValueError):
    """Bad input from a user: the message names the problem and how to fix it."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or corrupt."""


class JobRefused(UserError):
    """The job must not run as configured here (its checkpoint dir is another job's):
    restarting it would fail the same way."""

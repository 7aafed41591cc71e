"""Typed errors. A UserError is a mistake in what a person gave us (flags, job file, checkpoint
path): the CLI prints its message as one line and exits non-zero, never a traceback."""


class UserError(ValueError):
    """Bad input from a user: the message names the problem and how to fix it."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or corrupt."""


class RestoreFailed(CheckpointError):
    """A checkpoint could not be restored, with what this rank saw (lazarus.core.contract,
    RESTORE_KINDS): `kind` is what was wrong from here -- "corrupt" (a checksum, a size, a
    malformed manifest: the checkpoint's fault), "missing" (the directory, manifest or a
    listed file is not there), "unreadable" (the storage refused to read: permission, I/O,
    the checkpoint root itself absent) -- or "" when this rank read its part and another rank
    did not; the message is the first problem any rank found."""

    def __init__(self, message: str, *, kind: str, own: str = ""):
        super().__init__(message)
        self.kind = kind
        self.own = own  # this rank's own finding ("" when it read its part)


class JobRefused(UserError):
    """The job must not run as configured here (its checkpoint dir is another job's):
    restarting it would fail the same way."""

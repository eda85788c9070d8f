"""npualloc's errors. Each carries the CLI exit code that reports it, so the
command line and scripts can tell the cases apart."""
from __future__ import annotations


class NpuallocError(Exception):
    """Anything npualloc cannot do; the message is one line meant for a user."""

    exit_code = 1


class NoSuchProcessError(NpuallocError):
    exit_code = 3


class NotUnderNpuallocError(NpuallocError):
    """The process runs, but has no (live) region: not preloaded, stats turned
    off with NPUALLOC_STATS=0, or no allocation made yet."""

    exit_code = 4


class OtherUserError(NpuallocError):
    exit_code = 5


class IncompatibleRegionError(NpuallocError):
    """The region was written by an npualloc with another layout version."""

    exit_code = 6


class CorruptRegionError(NpuallocError):
    """Truncated, damaged or not an npualloc region at all."""

    exit_code = 7


class CommandTimeoutError(NpuallocError):
    exit_code = 8


class CommandRejectedError(NpuallocError):
    """The process answered the command with an error: status, its
    NPUALLOC_CMD_* code (None where the caller did not give it)."""

    exit_code = 9

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ProcessStoppedError(NpuallocError):
    """The process is stopped (SIGSTOP, a debugger) inside an update of what
    was to be read: it can be read once the process continues."""

    exit_code = 10


class InvalidDeviceError(RuntimeError, ValueError):
    """A device index no device has: past the devices the runtime sees (past
    npualloc's 16 on any runtime), or negative. torch's check of it raises
    RuntimeError ("Invalid device argument"), and npualloc raised ValueError
    before: code written for either catches it."""


class CommandInterruptedError(KeyboardInterrupt):
    """Ctrl-C while waiting for the process to acknowledge a command: withdrawn
    unless the process took it already (the message says which). A KeyboardInterrupt, not an
    NpuallocError, so code that handles npualloc's errors does not swallow
    the user's Ctrl-C; the CLI says it and exits 130 (the shell's code for
    SIGINT)."""

    exit_code = 130

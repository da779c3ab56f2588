"""The error classes every module may import (no imports of its own).

A JobError is a problem with what the user gave the job (a config key, a data file, a checkpoint, a
folder, settings under which training went NaN/Inf): whoever catches it last prints its message as
one line naming that thing, without a traceback, and exits non-zero. Any other exception is a bug or
a fault and keeps its traceback.
"""


class JobError(Exception):
    """A problem with the job's input: its message names the key, file or folder and what is wrong."""


class CheckpointError(JobError):
    """A checkpoint that cannot be used: missing, incomplete, tampered with, or of another job."""

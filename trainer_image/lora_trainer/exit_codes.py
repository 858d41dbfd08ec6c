"""The trainer's exit-code table: the contract between `lora-trainer` and the JobSet.

The operator renders its podFailurePolicy from these constants, so a user error fails
the JobSet at once while preemption and transient faults restart it (and the run
resumes from the last committed checkpoint).
"""

#: Training (or export/conversion) finished.
OK = 0
#: A bad command line or config, bad model files, bad data, bad adapter, out of host or accelerator memory: retrying cannot help. Fail fast.
USER_ERROR = 3
#: A transient fault (storage outage, preemption notice handled by saving): restart and resume.
RETRIABLE = 42
#: Ctrl-C (run by hand, e.g. the local mode), after saving a checkpoint (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
#: Exit codes at or above this are signal deaths (128 + n, e.g. 137 after SIGKILL); treated as retriable.
FIRST_SIGNAL_EXIT = 129
#: Highest exit code a process can report.
MAX_EXIT = 255


def retriable_exit_codes() -> list[int]:
    """Every exit code after which a JobSet restart may succeed."""
    return [RETRIABLE, *range(FIRST_SIGNAL_EXIT, MAX_EXIT + 1)]

"""The trainer's exit-code table: the contract between `lora-trainer` and the JobSet.

The operator renders its podFailurePolicy from these constants, so a user error fails
the JobSet at once while preemption and transient faults restart it (and the run
resumes from the last committed checkpoint); a restart after a preemption does not
count toward the run's `maxRestarts`.
"""

#: Training (or export/conversion) finished.
OK = 0
#: A bad command line or config, bad model files, data or adapter, a storage location that is missing or refused (a missing bucket or input, 403, a full disk), out of host or accelerator memory: retrying cannot help. Fail fast.
USER_ERROR = 3
#: A transient fault (a storage outage: 429, 5xx, timeouts or dropped connections past the retry deadline): restart and resume. Counts toward maxRestarts, so a fault that lasts ends the run.
RETRIABLE = 42
#: Stopped by SIGTERM (preemption, node maintenance, pod deletion) after committing a checkpoint: restart and resume, not counted.
PREEMPTED = 43
#: Ctrl-C (run by hand, e.g. the local mode), after saving a checkpoint (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
#: Exit codes at or above this are signal deaths (128 + n, e.g. 137 after SIGKILL); treated as retriable.
FIRST_SIGNAL_EXIT = 129
#: Highest exit code a process can report.
MAX_EXIT = 255


def retriable_exit_codes() -> list[int]:
    """Every exit code after which a JobSet restart may succeed."""
    return [RETRIABLE, PREEMPTED, *range(FIRST_SIGNAL_EXIT, MAX_EXIT + 1)]

"""Errors that map to the exit-code table: one paragraph that names the thing and the fix."""

from __future__ import annotations

from lora_trainer import exit_codes


class TrainerError(Exception):
    """Base of errors the CLI turns into an exit code and a one-paragraph message."""

    exit_code = exit_codes.USER_ERROR


class UserError(TrainerError):
    """Bad config, model files, data or adapter: retrying will not help; the message says what to change."""

    exit_code = exit_codes.USER_ERROR


class RetriableError(TrainerError):
    """A transient fault (storage outage, preemption): the JobSet restarts and the run resumes."""

    exit_code = exit_codes.RETRIABLE

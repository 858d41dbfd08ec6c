"""The progress record: what the trainer writes to `<output>/progress.json`, stdout and its
callback, and what the operator and local mode read back (docs/dev/contracts.md, "Progress
channel"). One typed declaration for the writer and every reader; light (pydantic only), so the
operator image imports it without JAX.

On the wire the keys are camelCase (`totalSteps`, `tokensPerSecond`, ...). A reader takes what
it is given: a field missing or of the wrong type reads as None and the others still count (a
record written by another trainer version never stops the status from moving).
"""

from __future__ import annotations

import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator
from pydantic.alias_generators import to_camel

Number = StrictFloat | StrictInt


def now_rfc3339() -> str:
    """UTC wall time, second precision, `Z` suffix (the one clock helper of both packages)."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


class ProgressRecord(BaseModel):
    """One progress record; field order is the key order on the wire."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)

    step: StrictInt | None = None
    total_steps: StrictInt | None = None
    loss: Number | None = None
    learning_rate: Number | None = None
    tokens_per_second: Number | None = None
    """None for an interval holding only the step that compiled the train step."""
    step_time_seconds: Number | None = None
    eta_seconds: Number | None = None
    eta: StrictStr | None = None
    """`eta_seconds` for people: `1h02m`, `4m05s`, `12s`."""
    mfu: Number | None = None
    last_checkpoint: StrictStr | None = None
    time: StrictStr | None = None

    @field_validator("*", mode="wrap")
    @classmethod
    def _lenient(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            return None

    @classmethod
    def parse(cls, record: Any) -> ProgressRecord | None:
        """The record from its decoded JSON (None if it is not an object)."""
        return cls.model_validate(record) if isinstance(record, dict) else None

    def to_wire(self) -> dict[str, Any]:
        """The JSON object, every key present (null when unknown), camelCase."""
        return self.model_dump(by_alias=True)

    def untimed(self) -> bool:
        """The interval held only the step that compiled the train step (its timing fields are null)."""
        return self.tokens_per_second is None and "step_time_seconds" in self.model_fields_set and self.step_time_seconds is None

    def with_checkpoint(self, uri: str) -> ProgressRecord:
        return self.model_copy(update={"last_checkpoint": uri})

"""A job's step series: a list of step records, and a DataFrame of them when pandas is there."""

from typing import Any, TypedDict

COLUMNS = (
    "attempt",
    "step",
    "loss",
    "loss_scale",
    "tokens_per_second",
    "skipped",
    "step_seconds",
    "at",
    "validation_loss",
)


class StepRecord(TypedDict):
    """One optimizer step as rank 0 reported it (`StepRecord` in the OpenAPI document)."""

    attempt: int
    step: int
    loss: float
    loss_scale: float
    tokens_per_second: float
    skipped: bool
    step_seconds: float
    at: int
    """Milliseconds since the Unix epoch."""
    validation_loss: float | None
    """The mean loss over the validation batches when validation ran after this step, else None."""


class Steps(list[StepRecord]):
    """Every step of every attempt, in order (a resumed attempt repeats the steps after its
    checkpoint)."""

    def to_pandas(self) -> Any:
        """A `pandas.DataFrame`, a row per step, the columns of `StepRecord`, `at` as UTC
        timestamps, `validation_loss` NaN on steps without validation. Needs pandas
        (`pip install 'zerotrain[pandas]'`)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("Steps.to_pandas needs pandas: pip install 'zerotrain[pandas]'") from e
        frame = pd.DataFrame(list(self), columns=list(COLUMNS))
        frame["at"] = pd.to_datetime(frame["at"], unit="ms", utc=True)
        # Floats even when no step validated (a column of None alone would be objects).
        frame["validation_loss"] = frame["validation_loss"].astype("float64")
        return frame

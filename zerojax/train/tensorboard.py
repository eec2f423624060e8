"""TensorBoard event files beside metrics.jsonl: every number of a step's record as a scalar at that
step, through the `tensorboard` package's own event writer (the optional extra `zerojax[tensorboard]`).

`train.tensorboard`: None (the default) writes them when `tensorboard` is importable, true requires
it, false writes none.
"""

from __future__ import annotations

import importlib.util
import math
import time

from zerojax.errors import UserError

INSTALL = "pip install 'zerojax[tensorboard]'"


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def check_setting(setting: bool | None) -> None:
    """`train.tensorboard=true` without the package is one sentence, before any training."""
    if setting and not available():
        raise UserError(f"train.tensorboard=true needs the tensorboard package: {INSTALL}, or set it to false.")


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers by tag, the step left out (it is the event's step); a value
    metrics.jsonl writes as null (non-finite) is NaN."""
    return {
        key: math.nan if value is None else float(value)
        for key, value in record.items()
        if key != "step" and (value is None or isinstance(value, int | float))
    }


class ScalarWriter:
    """One event file in `logdir`; `write(record)` adds its scalars at `record["step"]`."""

    def __init__(self, logdir: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(logdir)

    def write(self, record: dict) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(record).items()]
        self._writer.add_event(Event(wall_time=time.time(), step=int(record["step"]), summary=Summary(value=values)))

    def close(self) -> None:
        self._writer.close()  # flushes the queue: the file is complete when the run returns


def open_writer(logdir: str, setting: bool | None) -> ScalarWriter | None:
    """The writer a run's `train.tensorboard` setting asks for, or None."""
    check_setting(setting)
    if setting is False or not available():
        return None
    return ScalarWriter(logdir)

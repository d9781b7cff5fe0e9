"""The protocol's knobs, in one object (`fp8train.amax.settings`): what the environment sets (the
async switch) and what tests, benchmarks and the GPU check change (the initial wire size, the
verdict lag, reducing on one rank, stand-in timing events) through `override`, never by patching
module globals."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, ClassVar, Iterator, Optional

__all__ = ["ENV_ASYNC", "Settings", "settings"]

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"


@dataclasses.dataclass
class Settings:
    ENV_ASYNC: ClassVar[str] = ENV_ASYNC  # the environment variable of the async switch

    # Amaxes every collective can carry from the start (16 KiB with the header), so that a model of up
    # to that many roles per direction never needs a blocking size handshake (design.md, section 3: a
    # pipeline stage must not block at its region's exit); more grows the size once, with a handshake.
    # Read by each new channel (a process group's first amax group).
    initial_wire: int = 4096
    # Launches between folding a verdict on the device and reading it on the host, per device type
    # (channel.py): on CUDA the copy has long arrived by then; on the CPU it is read at once.
    verdict_lag: dict[str, int] = dataclasses.field(default_factory=lambda: {"cuda": 8})
    # A one-rank amax group reduces anyway (collectives of one): the GPU check measures the wire on
    # one GPU. Off, a group of one rank reduces nothing (there is nothing to agree on).
    reduce_single_rank: bool = False
    # None: NVTE_ASYNC_AMAX_REDUCTION decides; True/False: asynchronous/blocking whatever it says.
    async_reduction: Optional[bool] = None
    # What times the reduction's waits (stats.Mark): None, an event on the device's current stream on
    # CUDA and the host clock elsewhere; a maker of recorded stand-in events (called with no argument)
    # runs the CUDA branch on any device (the GPU check's timing section, on the CPU).
    timing_events: Optional[Callable[[], Any]] = None

    def asynchronous(self) -> bool:
        """Whether reductions launched now are asynchronous: the override, else the environment
        (unset or '1' asynchronous, '0' blocking; anything else is an error)."""
        if self.async_reduction is not None:
            return self.async_reduction
        value = os.environ.get(ENV_ASYNC)
        if value is None or value.strip() == "1":
            return True
        if value.strip() == "0":
            return False
        raise ValueError(
            f"{ENV_ASYNC}={value!r} is not valid: use 1 (asynchronous, the default) or 0 (blocking)"
        )

    @contextlib.contextmanager
    def override(self, **changes) -> Iterator[Settings]:
        """These settings changed for the block, restored after it (fields by name)."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise TypeError(
                f"fp8train.amax.settings has no {', '.join(unknown)}; its fields: {sorted(fields)}"
            )
        saved = {name: getattr(self, name) for name in changes}
        for name, value in changes.items():
            setattr(self, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)


settings = Settings()

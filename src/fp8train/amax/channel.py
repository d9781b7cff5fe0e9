"""The amax all-reduces on one process group (docs/design.md, section 3): one size for all of them,
changed only through a handshake every rank sees; a failure flag checked on the device; and the
verdict, decided by launch count alone, of when every rank raises."""

from __future__ import annotations

import collections
from typing import Optional

import torch

from ..errors import LayoutMismatchError
from .header import HEADER_LEN, Member, mismatch_error
from .settings import settings
from .stats import HostMirror

__all__ = ["Channel"]


class StickyFlag:
    """A failure flag set on the device; the host reads it through a `HostMirror`."""

    def __init__(self, device: torch.device) -> None:
        self.value = torch.zeros((), dtype=torch.bool, device=device)
        self.mirror = HostMirror(self.value)

    def set_where(self, failed: torch.Tensor) -> None:
        self.value |= failed
        self.mirror.publish(self.value)


class Channel:
    """The amax all-reduces on one process group: their common size, and whether one went wrong. The
    process group itself is kept by the amax groups that share the channel (`AmaxGroup.process_group`).

    A failed check anywhere on the channel stops every later update on it (the flag is checked on the
    device by every reduction): after a mismatch, collectives may be paired with the wrong partners.

    When to raise is decided by launch count alone, so that every rank raises at the same launch
    whatever the timing of its device: launch k raises if a reduction launched at k - 2 or earlier
    (finished by then in a normal loop; waited for otherwise) disagreed. The disagreements are folded
    on the device into `verdict`, whose host copy is read `settings.verdict_lag` launches later (at
    once on the CPU; on CUDA the copy has long arrived by then, so the read does not stall the host).
    """

    def __init__(self) -> None:
        self.agreed = settings.initial_wire  # values after the header, agreed by every rank (in a handshake)
        self.directions: list[Member] = []
        self.flag: Optional[StickyFlag] = None
        self.failure: Optional[torch.Tensor] = None  # [direction, reduced header, local header]
        self.error: Optional[LayoutMismatchError] = None
        self.launches = 0
        self.unfolded: collections.deque[tuple[int, Member]] = collections.deque()  # launched, not folded
        self.disagreed: dict[int, torch.Tensor] = {}  # launch index -> the ranks' headers differed (device)
        self.verdict: Optional[torch.Tensor] = None  # a folded reduction disagreed (device bool)
        self.verdicts: collections.deque[tuple[int, HostMirror]] = collections.deque()  # copies on their way
        self._spare: Optional[HostMirror] = None  # a verdict copy read already, for reuse

    def attach(self, direction: Member, device: torch.device) -> None:
        if self.flag is None:
            self.flag = StickyFlag(device)
            self.failure = torch.zeros(1 + 2 * HEADER_LEN, device=device)
            self.verdict = torch.zeros((), dtype=torch.bool, device=device)
        elif self.flag.value.device != device:
            raise ValueError(
                f"FP8 modules on {device} and on {self.flag.value.device} use the same amax reduction "
                "process group; one process group carries the FP8 state of one device"
            )
        self.directions.append(direction)

    def agrees(
        self, reduced: torch.Tensor, local: torch.Tensor, direction: Member, index: int = -1
    ) -> torch.Tensor:
        """Whether every rank sent the same header and nothing failed before (a device bool). The
        disagreement of launch `index` is kept for the verdict (section docstring)."""
        pairs = reduced.view(-1, 2)
        agree = (pairs[:, 0] == -pairs[:, 1]).all()
        ok = agree & ~self.flag.value
        first = ~ok & ~self.flag.value
        record = torch.cat(
            [torch.full((1,), float(self.directions.index(direction)), device=reduced.device), reduced, local]
        )
        self.failure.copy_(torch.where(first, record, self.failure))
        self.flag.set_where(~ok)
        if index >= 0:
            self.disagreed[index] = ~agree
        return ok

    @property
    def failed(self) -> bool:
        """Whether a mismatch has been seen here (waits for the device: for host points only)."""
        return self.error is not None or (self.flag is not None and bool(self.flag.mirror.wait()))

    def failure_message(self) -> str:
        try:
            self.check(block=True)
        except LayoutMismatchError as exc:
            return str(exc)
        return ""

    def grow(self, wire: int) -> None:
        """Every rank agreed (in a blocking handshake) that collectives carry `wire` values from now on."""
        self.agreed = wire

    def unfinished_before_launch(self) -> list[Member]:
        """The directions whose launches the next launch folds into the verdict but whose reductions
        have not been checked yet (no FP8 call used them): the caller finishes them first
        (`Direction.launch`). Raises the mismatch this channel raised before."""
        self.check()
        due = self.launches + 1 - 2
        return [owner for done, owner in self.unfolded if done <= due and done not in self.disagreed]

    def begin_launch(self, direction: Member) -> int:
        """Decide whether this launch raises (the same decision on every rank: see the class docstring),
        and return its index. The launches it folds were finished (`unfinished_before_launch`)."""
        self.check()
        self.launches += 1
        index = self.launches
        while self.unfolded and self.unfolded[0][0] <= index - 2:
            done, _ = self.unfolded.popleft()
            if done in self.disagreed:  # (absent only when a failure already stopped the updates)
                self.verdict |= self.disagreed.pop(done)
        mirror = self._spare or HostMirror(self.verdict)
        mirror.publish(self.verdict)
        self.verdicts.append((index, mirror))
        due, oldest = self.verdicts[0]
        if due <= index - settings.verdict_lag.get(self.verdict.device.type, 0):
            self._spare = self.verdicts.popleft()[1]
            if bool(oldest.wait()):
                self.error = self._mismatch_error()
                self.check()
        self.unfolded.append((index, direction))
        return index

    def check(self, block: bool = False) -> None:
        """Raise the mismatch this channel raised before (sticky: again at every call). At a host point
        (`block`), also one that the device has seen since (this rank alone: it waits for the device)."""
        if block and self.error is None and self.flag is not None and bool(self.flag.mirror.wait()):
            self.error = self._mismatch_error()
        if self.error is not None:
            raise type(self.error)(str(self.error))

    def _mismatch_error(self) -> LayoutMismatchError:
        """The error for the first mismatch seen (reads the device: only when failing)."""
        values = self.failure.tolist()
        reduced, local = values[1 : 1 + HEADER_LEN], values[1 + HEADER_LEN :]
        return mismatch_error(self.directions[int(values[0])], reduced, local)

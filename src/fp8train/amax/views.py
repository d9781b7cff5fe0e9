"""Reading the protocol's state: the public readers (`synchronize`, `reduction_stats`) and a small
view of it for tests, telemetry and benchmarks (`fp8train.inspection`; docs/design.md, section 3):
delayed scaling's amax groups (amax/state.py) and the runtime's regions (`fp8train.runtime`).

The views read the live state through a narrow surface (what a test or a dashboard needs: the
storage of an amax group's direction, its members, reductions pending and in flight, roles recorded
so far); nothing here changes training except `reset()` and `DirectionView.complete()`, which do what
their names say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..runtime import KEPT_REGIONS, STATE
from .reduction import AmaxGroup, Direction
from .state import AMAX
from .storage import ScalingStorage

__all__ = [
    "synchronize",
    "reduction_stats",
    "reset_reduction_stats",
    "reset",
    "open_regions",
    "current_region",
    "RegionView",
    "amax_groups",
    "amax_group",
    "AmaxGroupView",
    "DirectionView",
    "live_regions",
    "regions_owing_backward",
    "KEPT_REGIONS",
    "counters",
]


# ---- the public readers ----------------------------------------------------------------------------------
def synchronize() -> None:
    """Complete every in-flight amax reduction and apply it, then raise any mismatch. No collective."""
    AMAX.synchronize()


def reduction_stats(complete: bool = True) -> dict:
    """Per-process reduction counters: launched, bytes_reduced, exposed_wait_s, hidden_s, updates,
    nonfinite_amax_events.

    `exposed_wait_s` is what the reductions cost (time the waiting side stood still). `hidden_s` sums
    each reduction's launch-to-wait window, time overlapped with other work: not a cost, and it can
    exceed the training time (the windows overlap each other); `hidden_s / launched` is a reduction's
    mean time in flight (docs/telemetry.md).

    By default in-flight reductions are completed first (no collective is issued), so the counters
    include the last step's update; `complete=False` reads them without waiting for anything (CUDA
    timings and counts whose copies have not arrived are left for a later read).
    """
    if complete:
        synchronize()
    return AMAX.stats.as_dict(wait=complete)


def reset_reduction_stats() -> None:
    """Start `reduction_stats()` afresh: its counts and times since now (e.g. after warm-up steps)."""
    AMAX.stats.reset()


def counters() -> dict:
    """The reduction counters as they stand, without waiting for anything (telemetry)."""
    return AMAX.stats.as_dict(wait=False)


# ---- views for tests, telemetry and benchmarks ------------------------------------------------------------
def reset() -> None:
    """Forget every region, amax group, channel and counter of this process (between tests or
    benchmark runs; modules that trained before keep their FP8 state as views of dropped groups)."""
    STATE.reset()


def open_regions() -> int:
    """How many fp8_autocast regions are active (nested), 0 outside any."""
    return len(STATE.regions.stack)


@dataclass(frozen=True)
class RegionView:
    serial: int  # outermost regions are numbered from 1 in the order they are entered
    async_op: bool  # its reductions are launched asynchronously (NVTE_ASYNC_AMAX_REDUCTION)


def current_region() -> Optional[RegionView]:
    """The outermost region being run, or None."""
    region = STATE.regions.region
    return None if region is None else RegionView(region.serial, region.async_op)


@dataclass(frozen=True)
class DirectionView:
    """One direction ("fwd" or "bwd") of an amax group."""

    direction: Direction

    @property
    def name(self) -> str:
        """The direction: "fwd" or "bwd"."""
        return self.direction.name

    @property
    def storage(self) -> Optional[ScalingStorage]:
        """Every role's history (H x N), scale, scale_inv, recording slot and history digest (N)."""
        return self.direction.storage

    @property
    def fp8_max(self) -> float:
        """The largest finite value of this direction's FP8 encoding (448 for E4M3, 57344 for E5M2)."""
        return self.direction.fp8_max

    @property
    def members(self) -> list[str]:
        """The signature of each module that joined, in order (its columns follow in that order)."""
        return list(self.direction.members)

    @property
    def pending_reductions(self) -> int:
        """Reductions launched and not finished (their update not applied yet)."""
        return len(self.direction.pending)

    @property
    def in_flight(self) -> int:
        """Pending reductions whose collective has not been waited for."""
        return sum(1 for p in self.direction.pending if p.works)

    @property
    def recorded_roles(self) -> tuple[int, ...]:
        """Columns that recorded amaxes since the last launch."""
        return tuple(self.direction.recorded_columns)

    def complete(self) -> None:
        """Finish the pending reductions (wait, check, update): what any reader of FP8 state does."""
        self.direction.finish()


@dataclass(frozen=True)
class AmaxGroupView:
    group: AmaxGroup

    @property
    def fwd(self) -> DirectionView:
        """The forward direction (inputs and weights)."""
        return DirectionView(self.group.fwd)

    @property
    def bwd(self) -> DirectionView:
        """The backward direction (output gradients)."""
        return DirectionView(self.group.bwd)

    @property
    def training_regions(self) -> int:
        """How many regions trained this group (its regions' serial: the number every header carries)."""
        return self.group.training_regions


def amax_groups() -> list[AmaxGroupView]:
    """A view of every amax group of this process (one per delayed-scaling recipe and process group)."""
    return [AmaxGroupView(group) for group in AMAX.groups.values()]


def amax_group(recipe, process_group=None) -> AmaxGroupView:
    """The amax group of a DelayedScaling `recipe` on `process_group` (None: the world)."""
    return AmaxGroupView(AMAX.of(recipe, process_group))


def live_regions() -> int:
    """Regions still alive (at most KEPT_REGIONS recent ones, plus those autograd graphs hold)."""
    return len(STATE.regions.live())


def regions_owing_backward() -> int:
    """Live regions whose backward has not run while their graph lives."""
    return sum(region.owes_backward() for region in STATE.regions.live())

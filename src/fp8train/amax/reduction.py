"""The wire of the amax protocol: one direction's state, its MAX all-reduce, and the only wait.

docs/design.md, section 3. `Direction.launch` snapshots the recording slot (double buffering) and
starts one all-reduce over [header | amaxes] on its process group's `Channel` (channel.py: one size
for every collective on the group, and when to raise); `Direction.finish` is the only code that
reads a reduced buffer, and it waits on the collective first. When they run is decided by the
runtime telling the group (`AmaxGroup.exited` at a region's exit, `AmaxGroup.backward_ended` at a
backward pass's end: the hooks of runtime/state.py, section 3.1), by the step boundary
(`StepBoundary`, steps.py) and by the calls' plans (amax/hooks.py).

The header (header.py) is checked on the device: a reduction whose ranks disagree updates nothing
and sets a sticky flag, and every rank raises at the same later launch.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from ..errors import AmaxReductionError
from ..numerics.formats import fp8_max
from ..torch_internals import current_graph_task
from . import streams
from .header import HEADER_LEN, Header
from .stats import Mark, ReductionStats
from .storage import ScalingStorage, update_scaling

if TYPE_CHECKING:
    from ..recipe import DelayedScaling
    from ..runtime import Region
    from .channel import Channel

__all__ = ["AmaxGroup", "Direction", "PendingReduction", "StepBoundary"]


@dataclass
class PendingReduction:
    """A launched reduction: the snapshot buffer, its collectives, and this rank's header."""

    buffer: torch.Tensor  # [header | amaxes] reduced in place; only the amaxes when not reduced
    works: list  # torch.distributed Work handles still to wait on
    num_roles: int
    launched_at: Optional[Mark]  # after the collective was issued
    header: Optional[torch.Tensor] = None  # this rank's header; None when not reduced
    extra: Optional[torch.Tensor] = None  # amaxes beyond the agreed size (a growth step), reduced apart
    index: int = -1  # the channel's launch count at this launch
    stream: Optional[torch.cuda.Stream] = None  # the stream that launched it, which owns the buffers


class Direction:
    """One direction ("fwd" or "bwd") of an amax group: contiguous state, recording, reductions."""

    def __init__(
        self, name: str, recipe: DelayedScaling, channel: Optional[Channel], stats: ReductionStats
    ) -> None:
        self.name = name
        self.recipe = recipe
        self.channel = channel  # None: nothing to reduce (one rank, or reduce_amax=False)
        self.stats = stats
        self.frozen: Optional[tuple] = None  # (region serial, its FrozenScales): state.frozen_scales
        self.encoding = recipe.fp8_format.fwd if name == "fwd" else recipe.fp8_format.bwd
        self.fp8_max = fp8_max(self.encoding)
        self.storage: Optional[ScalingStorage] = None
        self.members: list[str] = []  # signature of each registered module, in order
        self.recipe_key = recipe.key()
        self.header = Header(name, self.recipe_key)
        self._recording_task = -1  # autograd graph task of the amaxes in the recording slot
        # the columns recorded since the last launch, in the order of their first record (a dict: an
        # ordered set); a column not in it holds 0 in the recording slot
        self.recorded_columns: dict[int, None] = {}
        self.pending: collections.deque[PendingReduction] = collections.deque()
        self.group: Optional[AmaxGroup] = None  # set by the AmaxGroup that holds this direction
        # (storage.recording, the scale, scale_inv and recording views of its columns): `_views`
        self._storage_views: Optional[tuple] = None

    # ---- layout ---------------------------------------------------------------------------------
    def register(
        self, signature: str, history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor
    ) -> int:
        """Append one module's roles (with their current state) and return their first column."""
        if history.shape[0] != self.recipe.amax_history_len:
            raise ValueError(
                f"{signature}: its FP8 state has amax history length {history.shape[0]} but the recipe in "
                f"effect has amax_history_len={self.recipe.amax_history_len}; use the recipe the "
                "checkpoint was trained with"
            )
        if self.storage is None:
            if self.channel is not None:
                self.channel.attach(self, scale.device)
            self.storage = ScalingStorage(self.recipe.amax_history_len, scale.device)
        elif scale.device != self.storage.device:
            raise ValueError(
                f"{signature} is on {scale.device} but other FP8 modules of this amax group are on "
                f"{self.storage.device}; one amax group holds modules of one device"
            )
        self.members.append(signature)
        self.header.add_member(signature)
        return self.storage.append(history, scale, scale_inv)

    def describe(self) -> str:
        head = ", ".join(self.members[:6]) + (", ..." if len(self.members) > 6 else "")
        roles = self.storage.num_roles if self.storage is not None else 0
        return f"{len(self.members)} modules / {roles} {self.name} roles [{head}]"

    def _views(self) -> tuple:
        # (the storage's recording tensor, each column's scale and scale_inv and recording slot as
        # 0-dim views): three unbinds while the storage stands, where each record would `select` its
        # slot and each gradient cast its scales; made again when the storage grows (it replaces all
        # its tensors at once, `ScalingStorage.append`). The lean path, docs/design.md, section 6.
        views = self._storage_views
        storage = self.storage
        if views is None or views[0] is not storage.recording:
            recording = storage.recording
            views = (recording, storage.scale.unbind(), storage.scale_inv.unbind(), recording.unbind())
            self._storage_views = views
        return views

    # ---- recording ------------------------------------------------------------------------------
    def recording_slot(self, column: int) -> torch.Tensor:
        """`column`'s recording slot, a 0-dim float32 view made once per storage (`_views`), for an amax
        recorded now: the cast that takes the amax MAXes it in (`cast.cast_with_amax`'s `amax_out`: no
        call of its own), or `record` does. The column counts as recorded from here on."""
        views = self._storage_views
        if views is None or views[0] is not self.storage.recording:
            views = self._views()
        task = current_graph_task()
        if task != self._recording_task:
            if self.recorded_columns:
                # Left by a backward pass that raised before its end-of-pass launch: those amaxes
                # belong to no completed step, and folding them into this one would change its scales.
                self.discard_recording()
            self._recording_task = task
        self.recorded_columns[column] = None
        return views[3][column]

    def record(self, column: int, amax: torch.Tensor) -> None:
        """MAX `amax` (a 0-dim tensor) into `column`'s recording slot: one aten call for a float32 amax."""
        slot = self.recording_slot(column)
        torch.maximum(slot, amax if amax.dtype == torch.float32 else amax.float(), out=slot)

    def scale_views(self, column: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`column`'s scale and scale_inv as 0-dim views of the storage (they follow its updates, which
        are in place), for an eager gradient cast: no `select` per cast."""
        views = self._storage_views
        if views is None or views[0] is not self.storage.recording:
            views = self._views()
        return views[1][column], views[2][column]

    def discard_recording(self) -> None:
        """Forget amaxes of a region that failed; what is launched for it is then empty."""
        if self.storage is not None:
            self.storage.recording.zero_()
        self.recorded_columns.clear()

    # ---- per-step reduction -----------------------------------------------------------------------
    def accumulate(self) -> None:
        """A completed region or backward pass of a per-step group: MAX its amaxes into the step's."""
        if self.recorded_columns:
            storage = self.storage
            torch.maximum(storage.accumulated, storage.recording, out=storage.accumulated)
            storage.recording.zero_()
            self.recorded_columns.clear()

    def restore_accumulated(self, offset: int, amaxes: torch.Tensor) -> None:
        """A checkpoint saved mid-step: the step's amaxes so far of the columns from `offset` on."""
        self.storage.accumulated[offset : offset + amaxes.numel()].copy_(amaxes)

    def launch_step(self, async_op: bool, step_index: int) -> None:
        """The step boundary: launch the step's accumulated amaxes as one reduction of every column,
        also when this rank recorded none (zeros: neutral for MAX, and a column whose reduced amax
        is 0 neither rolls nor changes scale), so that the header does not depend on what ran here."""
        self.accumulate()
        if self.storage is None:
            return
        storage = self.storage
        storage.recording.copy_(storage.accumulated)
        storage.accumulated.zero_()
        self.recorded_columns = dict.fromkeys(range(storage.num_roles))
        self.launch(async_op, step_index)

    # ---- the collective -------------------------------------------------------------------------
    def launch(self, async_op: bool, region_index: int) -> None:
        """Snapshot and clear the recording slot, then start the MAX all-reduce on the snapshot."""
        storage = self.storage
        stream = streams.current_stream(storage.device)  # owns the buffers allocated here
        n = storage.num_roles
        columns = tuple(sorted(self.recorded_columns))
        self.recorded_columns.clear()
        channel = self.channel
        if channel is None:
            snapshot = _nan_as_inf(storage.recording)  # a copy, as if it had been reduced
            storage.recording.zero_()
            self.pending.append(PendingReduction(snapshot, [], n, Mark.now(snapshot.device), stream=stream))
            return
        for owner in channel.unfinished_before_launch():  # what this launch's verdict folds: checked first
            owner.finish()
        index = channel.begin_launch(self)  # raises on every rank alike; no further collective then
        self.finish()  # the state digest must cover every earlier update (normally already applied)
        agreed = channel.agreed
        wire = max(n, agreed)
        buffer = torch.zeros(HEADER_LEN + wire, device=storage.device)
        amaxes = buffer[HEADER_LEN : HEADER_LEN + n]
        _nan_as_inf(storage.recording, out=amaxes)  # NCCL's MAX may drop NaN
        storage.recording.zero_()
        header = self.header.write(storage, len(self.members), columns, region_index, wire)
        buffer[:HEADER_LEN].copy_(header)
        pending = PendingReduction(buffer, [], n, None, header, index=index, stream=stream)
        if wire == agreed:
            pending.works.append(self._all_reduce(buffer, async_op))
            pending.launched_at = Mark.now(buffer.device)
        else:
            # The layout grew: settle the header first (blocking, checked on the host), so that ranks
            # never issue collectives of different sizes, then reduce the new values.
            pending.buffer = buffer[: HEADER_LEN + agreed]
            pending.extra = buffer[HEADER_LEN + agreed :].clone()
            self._all_reduce(pending.buffer, async_op=False)
            if not bool(channel.agrees(pending.buffer[:HEADER_LEN], header, self)):
                channel.check(block=True)
            channel.grow(wire)
            pending.works.append(self._all_reduce(pending.extra, async_op))
            pending.launched_at = Mark.now(buffer.device)
        self.pending.append(pending)

    def _all_reduce(self, buffer: torch.Tensor, async_op: bool):
        """Start the collective; in blocking mode complete it here and count it all as exposed."""
        self.stats.launched += 1
        self.stats.bytes_reduced += buffer.numel() * buffer.element_size()
        start = Mark.now(buffer.device)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group.process_group, async_op=True)
        if async_op:
            return work
        self._wait_work(work)
        self.stats.add_interval("exposed_wait_s", start, Mark.now(buffer.device))
        return None

    def _wait_work(self, work) -> None:
        """Wait on one collective; a failed or timed-out one becomes an error that says what it was."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise AmaxReductionError(
                f"the {self.name} amax all-reduce of rank {dist.get_rank()} failed ({self.describe()}): "
                "another rank of the amax group died, stalled beyond the process group timeout or left "
                "the group. This rank's FP8 scales and histories were not updated from it; its last "
                f"saved checkpoint is the state to resume from. Cause: {exc}"
            ) from exc

    # ---- the only wait --------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for every launched reduction, check it on the device, then run the fused update.

        Each runs on the stream that launched it, which owns its buffers and the FP8 state; a caller on
        another stream (FSDP2's all-gather) then waits for it (streams.py)."""
        while self.pending:
            pending = self.pending.popleft()
            if self.channel is not None and self.channel.error is not None:
                continue  # after a mismatch the collectives may be mispaired: apply nothing more
            if pending.stream is None:  # (off CUDA: no stream to queue on)
                self._apply(pending)
                continue
            with streams.queued_on(pending.buffer.device, pending.stream):
                self._apply(pending)

    def _apply(self, pending: PendingReduction) -> None:
        self._wait(pending)
        n = pending.num_roles
        ok = None
        last = pending.buffer
        if pending.header is not None:
            amaxes = pending.buffer[HEADER_LEN:]
            if pending.extra is not None:
                amaxes = torch.cat([amaxes, pending.extra])
            last = amaxes[:n]
            ok = self.channel.agrees(pending.buffer[:HEADER_LEN], pending.header, self, pending.index)
        storage = self.storage
        self.stats.updates += 1
        if last.shape[0] != n:  # (the unreduced snapshot is the amaxes: no slice)
            last = last[:n]
        self.stats.count_nonfinite(last, ok)
        state = storage.history, storage.scale, storage.scale_inv, storage.digest
        if n != storage.num_roles:  # a module joined since the launch: its columns wait (else no slices)
            state = storage.history[:, :n], storage.scale[:n], storage.scale_inv[:n], storage.digest[:n]
        history, scale, scale_inv, digest = state
        update_scaling(history, scale, scale_inv, last, self.recipe, self.fp8_max, ok, digest)

    def settle(self, host_point: bool = False) -> None:
        """Complete the reductions before the state is read; issues no collective.

        Only at a host point (a checkpoint) is a mismatch raised: seen on the device, even if its flag
        has not reached the host yet (this waits for the device). Other readers can inspect the state
        after one."""
        self.finish()
        if host_point:
            self.check(block=True)

    def failure_message(self) -> str:
        """Why an amax reduction of this direction's process group failed ("" if none did)."""
        return self.channel.failure_message() if self.channel is not None and self.channel.failed else ""

    def check(self, block: bool = False) -> None:
        """Raise a mismatch seen on this direction's process group (without waiting, unless `block`)."""
        if self.channel is not None:
            self.channel.check(block)

    def _wait(self, pending: PendingReduction) -> None:
        works = [w for w in pending.works if w is not None]
        if works:
            start = Mark.now(pending.buffer.device)
            self.stats.add_interval("hidden_s", pending.launched_at, start)
            for work in works:
                self._wait_work(work)
            self.stats.add_interval("exposed_wait_s", start, Mark.now(pending.buffer.device))


def _nan_as_inf(amaxes: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`amaxes` with NaN as inf (NCCL's MAX may drop a NaN, so it travels as inf; unreduced amaxes
    are made the same), every other value as it is: one op where a copy, an isnan and a masked fill
    would be three."""
    inf = float("inf")
    return torch.nan_to_num(amaxes, nan=inf, posinf=inf, neginf=-inf, out=out)


class AmaxGroup:
    """The FP8 state the ranks of `process_group` share under `recipe`: both directions, and the
    index of the group's training regions (each group counts its own: other groups never shift it)."""

    def __init__(
        self,
        recipe: DelayedScaling,
        process_group,
        channel: Optional[Channel],
        stats: ReductionStats,
        step: StepBoundary,
    ) -> None:
        self.recipe = recipe
        self.process_group = process_group
        self.step = step  # the step boundary that launches a per-step group
        self.fwd = Direction("fwd", recipe, channel, stats)
        self.bwd = Direction("bwd", recipe, channel, stats)
        self.fwd.group = self.bwd.group = self
        self.training_regions = 0  # (per-step reduction: its steps)
        self.latest_region = None  # the latest region that launched its forward reduction

    def exited(self, region: Region, failed: bool) -> None:
        """`region`, which trained this group, exits: its forward reduction launches now (a per-step
        group accumulates it for the step boundary, steps.py). A region that raised launches what it
        owes with its amaxes discarded, so a rank that caught an exception its peers did not have fails
        their header check instead of pairing other steps."""
        if failed:
            self.fwd.discard_recording()
        self.latest_region = region
        if self.recipe.per_step:  # kept for the step boundary (steps.py)
            self.fwd.accumulate()
            self.step.note_group(self)
        else:
            self.fwd.launch(region.async_op, region.index_of(self))

    def backward_ended(self, region: Region) -> None:
        """A backward pass that recorded into this group ended (`region`: the first it recorded for):
        its backward reduction launches now (a per-step group accumulates it)."""
        if self.recipe.per_step:  # kept for the step boundary (steps.py)
            self.bwd.accumulate()
            self.step.note_group(self)
        elif self.bwd.recorded_columns:
            self.bwd.launch(region.async_op, region.index_of(self))

    def next_region_index(self) -> int:
        index = self.training_regions
        self.training_regions += 1
        return index


class StepBoundary:
    """Per-step amax reduction's boundary: the groups to launch at it, and what detects a missing one."""

    def __init__(self) -> None:
        self.groups: dict[AmaxGroup, None] = {}  # per-step groups this rank trained, in that order
        self.taken = 0  # step boundaries taken
        self._parameters: dict[int, tuple] = {}  # module id -> its parameters' versions this step

    def note_group(self, group: AmaxGroup) -> None:
        """A per-step group that trained: launched at every step boundary from now on, in the order in
        which the groups first trained (the same on every rank)."""
        self.groups.setdefault(group, None)

    def take(self) -> list[AmaxGroup]:
        """A boundary: the groups to launch, in order; the next step starts."""
        self._parameters.clear()
        self.taken += 1
        return list(self.groups)

    def same_parameters(self, module_id: int, versions: tuple) -> bool:
        """Whether a module's parameter versions are those of its first training call of the step."""
        return self._parameters.setdefault(module_id, versions) == versions

    def parameters_loaded(self, module_id: int) -> None:
        self._parameters.pop(module_id, None)

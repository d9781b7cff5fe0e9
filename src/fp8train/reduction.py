"""The amax group: one direction's contiguous state, its MAX all-reduce and its pending handles.

Protocol (DESIGN.md section 3): `launch` snapshots the recording slot (double buffering), clears it,
and starts one all-reduce over the snapshot; `finish` is the only code that reads a reduced buffer,
and it waits on the handle first. `finish` never issues a collective, so a rank may call it alone
(e.g. rank 0 saving a checkpoint) without desynchronising the group.
"""

from __future__ import annotations

import collections
import hashlib
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .recipe import DelayedScaling, fp8_max
from .scaling import ScalingStorage, update_scaling

__all__ = ["AmaxGroup", "AmaxReductionError", "LayoutMismatchError", "ReductionStats", "PendingReduction"]

# Header of every reduced buffer: each quantity q is sent as (q, -q) so that one MAX reveals both
# the group's max and min. Quantities: two 24-bit halves of the fingerprint (direction, recipe,
# module signatures in order, roles that recorded), the number of roles, of modules, of roles that
# recorded an amax, and the index of the training region the amaxes belong to.
_HEADER_FIELDS = ("fingerprint_hi", "fingerprint_lo", "roles", "modules", "roles_recorded", "training_region")
_HEADER_LEN = 2 * len(_HEADER_FIELDS)


class LayoutMismatchError(RuntimeError):
    """Ranks of an amax group contributed different FP8 roles; no scale was updated."""


class AmaxReductionError(RuntimeError):
    """An amax all-reduce failed or timed out (a rank died or stalled); no scale was updated from it."""


def recipe_key(recipe: DelayedScaling) -> str:
    """The recipe fields every rank must agree on, as text that is the same in every process."""

    def name(algo) -> str:
        if algo is None or isinstance(algo, str):
            return repr(algo)
        return f"{getattr(algo, '__module__', '?')}.{getattr(algo, '__qualname__', type(algo).__qualname__)}"

    return (
        f"margin={recipe.margin}, fp8_format={recipe.fp8_format.name}, "
        f"amax_history_len={recipe.amax_history_len}, amax_compute_algo={name(recipe.amax_compute_algo)}, "
        f"scaling_factor_compute_algo={name(recipe.scaling_factor_compute_algo)}"
    )


@dataclass
class ReductionStats:
    """Per-process counters, readable through `fp8train.reduction_stats()`."""

    launched: int = 0
    bytes_reduced: int = 0
    exposed_wait_s: float = 0.0  # time blocked in wait()
    hidden_s: float = 0.0  # time from launch to the start of wait(): overlapped with other work
    updates: int = 0
    nonfinite_amax_events: int = 0

    _nonfinite_on_device: dict = field(default_factory=dict)  # device -> count not yet read (no sync)

    def count_nonfinite(self, last: torch.Tensor) -> None:
        count = torch.isinf(last).sum()
        previous = self._nonfinite_on_device.get(last.device)
        self._nonfinite_on_device[last.device] = count if previous is None else previous + count

    def as_dict(self) -> dict:
        for count in self._nonfinite_on_device.values():
            self.nonfinite_amax_events += int(count)
        self._nonfinite_on_device.clear()
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


@dataclass
class PendingReduction:
    """A launched reduction: the snapshot buffer, its handle, and what is needed to check it."""

    buffer: torch.Tensor  # header + amaxes, reduced in place
    work: Optional[object]  # torch.distributed Work, or None once completed / never started
    num_roles: int
    launched_at: float
    local_header: list = field(default_factory=list)
    extra: Optional[tuple] = None  # (buffer, work) for the columns added by a layout growth


class AmaxGroup:
    """One direction ("fwd" or "bwd") of the FP8 state shared by a (recipe, process group)."""

    def __init__(self, direction: str, recipe: DelayedScaling, process_group, stats: ReductionStats) -> None:
        self.direction = direction
        self.recipe = recipe
        self.process_group = process_group
        self.stats = stats
        encoding = recipe.fp8_format.fwd if direction == "fwd" else recipe.fp8_format.bwd
        self.encoding = encoding
        self.fp8_max = fp8_max(encoding)
        self.storage: Optional[ScalingStorage] = None
        self.members: list[str] = []  # signature of each registered module, in order
        # The recipe seeds the layout fingerprint: ranks with different recipes (margin, history
        # length, algorithms) would otherwise reduce happily and silently compute different scales.
        self.recipe_key = recipe_key(recipe)
        seed = f"{direction} {self.recipe_key}".encode()
        self._layout_digest = hashlib.blake2b(seed, digest_size=8).digest()
        self._recording_task = -1  # autograd graph task of the amaxes in the recording slot
        self.recorded_columns: list[int] = []
        self.pending: collections.deque[PendingReduction] = collections.deque()
        self.agreed_roles = 0  # wire roles all ranks agreed on in an earlier launch
        # Values sent per step, padded so that a forward and a backward collective of the same modules
        # have the same size: ranks that fall out of step then fail the header check (the direction
        # is in the fingerprint) instead of aborting on collectives of different sizes.
        self.wire_roles = 0
        self._check_group()

    # ---- layout -----------------------------------------------------------------------------
    def _check_group(self) -> None:
        # Not `self.reduces`: a group this rank is not in reports world size -1, which reads as "no
        # reduction" and would let the rank train alone, silently, with its own scales.
        initialized = dist.is_available() and dist.is_initialized()
        if self.recipe.reduce_amax and initialized and dist.get_rank(self.process_group) < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of the amax reduction group passed to "
                "fp8_autocast(fp8_group=...); pass a group that contains every rank that runs this region"
            )

    @property
    def reduces(self) -> bool:
        return (
            self.recipe.reduce_amax
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )

    def register(
        self,
        signature: str,
        history: torch.Tensor,
        scale: torch.Tensor,
        scale_inv: torch.Tensor,
        wire_roles: Optional[int] = None,
    ) -> int:
        """Append one module's roles (with their current state) and return their first column.

        `wire_roles` (>= its roles) is how many values the module sends per reduction."""
        if history.shape[0] != self.recipe.amax_history_len:
            raise ValueError(
                f"{signature}: its FP8 state has amax history length {history.shape[0]} but the recipe in "
                f"effect has amax_history_len={self.recipe.amax_history_len}; use the recipe the "
                "checkpoint was trained with"
            )
        if self.storage is None:
            self.storage = ScalingStorage(self.recipe.amax_history_len, scale.device)
        elif scale.device != self.storage.device:
            raise ValueError(
                f"{signature} is on {scale.device} but other FP8 modules of this region are on "
                f"{self.storage.device}; one amax group holds modules of one device"
            )
        self.members.append(signature)
        self.wire_roles += max(wire_roles or 0, scale.numel())
        self._layout_digest = hashlib.blake2b(
            self._layout_digest + signature.encode(), digest_size=8
        ).digest()
        return self.storage.append(history, scale, scale_inv)

    def _header(self, columns: list[int], region_index: int) -> list[float]:
        digest = hashlib.blake2b(self._layout_digest + repr(columns).encode(), digest_size=6).digest()
        values = [
            float(int.from_bytes(digest[:3], "little")),
            float(int.from_bytes(digest[3:], "little")),
            float(self.storage.num_roles),
            float(len(self.members)),
            float(len(columns)),
            float(region_index % 2**24),  # ranks at different steps pair the wrong collectives
        ]
        return [x for v in values for x in (v, -v)]

    def describe(self) -> str:
        head = ", ".join(self.members[:6]) + (", ..." if len(self.members) > 6 else "")
        return f"{len(self.members)} modules / {self.storage.num_roles} {self.direction} roles [{head}]"

    # ---- recording ----------------------------------------------------------------------------
    def record(self, column: int, amax: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if self.recorded_columns and task != self._recording_task:
            # Left by a backward pass that raised before its end-of-pass launch: those amaxes belong
            # to no completed step, and folding them into this one would change its scales.
            self.discard_recording()
        self._recording_task = task
        slot = self.storage.recording[column]
        torch.maximum(slot, amax.to(torch.float32), out=slot)
        self.recorded_columns.append(column)

    def discard_recording(self) -> None:
        """Forget amaxes of a region that failed; nothing was launched for them."""
        if self.storage is not None:
            self.storage.recording.zero_()
        self.recorded_columns.clear()

    # ---- the collective -----------------------------------------------------------------------
    def launch(self, async_op: bool, region_index: int = 0) -> None:
        """Snapshot and clear the recording slot, then start the MAX all-reduce on the snapshot."""
        storage = self.storage
        n = storage.num_roles
        snapshot = torch.nn.functional.pad(storage.recording, (0, self.wire_roles - n))  # a copy
        storage.recording.zero_()
        snapshot.masked_fill_(torch.isnan(snapshot), float("inf"))  # NCCL's MAX may drop NaN
        columns = sorted(set(self.recorded_columns))
        self.recorded_columns.clear()
        now = time.perf_counter()
        if not self.reduces:
            self.pending.append(PendingReduction(snapshot, None, n, now))
            return
        header = self._header(columns, region_index)
        wire = snapshot.numel()
        agreed = self.agreed_roles
        head = torch.tensor(header, dtype=torch.float32, device=snapshot.device)
        buffer = torch.cat([head, snapshot[:agreed]])
        pending = PendingReduction(buffer, None, n, now, header)
        if wire != agreed:
            # The layout grew since the last agreement: settle the header first (blocking), so that
            # ranks never issue collectives of different sizes, then reduce the new columns.
            self._all_reduce(buffer, async_op=False)
            self._check_header(buffer, header)
            extra = snapshot[agreed:].clone()
            pending.extra = (extra, self._all_reduce(extra, async_op))
            self.agreed_roles = wire
        else:
            pending.work = self._all_reduce(buffer, async_op)
        self.pending.append(pending)

    def _all_reduce(self, buffer: torch.Tensor, async_op: bool):
        """Start the collective; in blocking mode complete it here and count it all as exposed."""
        self.stats.launched += 1
        self.stats.bytes_reduced += buffer.numel() * buffer.element_size()
        start = time.perf_counter()
        work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        if async_op:
            return work
        self._wait_work(work)
        self.stats.exposed_wait_s += time.perf_counter() - start
        return None

    def _wait_work(self, work) -> None:
        """Wait on one collective; a failed or timed-out one becomes an error that says what it was."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise AmaxReductionError(
                f"the {self.direction} amax all-reduce of rank {dist.get_rank()} failed ({self.describe()}): "
                "another rank of the amax group died, stalled beyond the process group timeout or left "
                "the group. This rank's FP8 scales and histories were not updated from it; its last "
                f"saved checkpoint is the state to resume from. Cause: {exc}"
            ) from exc

    def _check_header(self, buffer: torch.Tensor, local: list[float]) -> None:
        reduced = buffer[:_HEADER_LEN].tolist()
        if all(reduced[2 * i] == -reduced[2 * i + 1] for i in range(len(_HEADER_FIELDS))):
            return
        spans = []
        for i, name in enumerate(_HEADER_FIELDS[2:], start=2):
            hi, lo = reduced[2 * i], -reduced[2 * i + 1]
            spans.append(f"{name}: this rank {int(local[2 * i])}, group min {int(lo)} max {int(hi)}")
        self.pending.clear()
        raise LayoutMismatchError(
            f"FP8 layout mismatch in the {self.direction} amax group (rank {dist.get_rank()}): ranks "
            f"contributed different modules, order or sizes, or a module ran on some ranks only, or "
            f"ranks use different recipes. {'; '.join(spans)}. This rank has {self.describe()} and "
            f"recipe ({self.recipe_key}). Every rank of the amax group must run the same FP8 modules "
            "in the same order under the same recipe; no scale was updated."
        )

    def finish(self) -> None:
        """Wait for every launched reduction, then unpack it and run the fused update."""
        while self.pending:
            pending = self.pending[0]
            last = self._wait(pending)[: pending.num_roles]
            self.pending.popleft()
            storage = self.storage
            n = pending.num_roles
            self.stats.updates += 1
            self.stats.count_nonfinite(last)
            update_scaling(
                storage.history[:, :n],
                storage.scale[:n],
                storage.scale_inv[:n],
                last,
                self.recipe,
                self.fp8_max,
            )

    def _wait(self, pending: PendingReduction) -> torch.Tensor:
        handles = [pending.work] + ([pending.extra[1]] if pending.extra else [])
        handles = [w for w in handles if w is not None]
        if handles:
            start = time.perf_counter()
            self.stats.hidden_s += start - pending.launched_at
            for work in handles:
                self._wait_work(work)
            self.stats.exposed_wait_s += time.perf_counter() - start
        if not pending.local_header:  # not reduced: the snapshot itself
            return pending.buffer
        self._check_header(pending.buffer, pending.local_header)
        parts = [pending.buffer[_HEADER_LEN:]] + ([pending.extra[0]] if pending.extra else [])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

"""The wire of the amax protocol: one direction's state, its MAX all-reduce, and the only wait.

docs/design.md, section 3. `Direction.launch` snapshots the recording slot (double buffering) and
starts one all-reduce over [header | amaxes]; `Direction.finish` is the only code that reads a
reduced buffer, and it waits on the collective first. When they run is decided in protocol.py.

The header is checked on the device: a reduction whose ranks disagree updates nothing and sets a
sticky flag. The host reads the flag without waiting (a non-blocking copy) at every later launch
and finish, and blocking at host points (`synchronize`, `state_dict`, `reduction_stats`); every
rank saw the same reduced header, so every rank raises the same error.

All amax all-reduces on one process group (its `Channel`) have the same size, HEADER_LEN + `agreed`,
whatever their direction or recipe. Ranks that fall out of step therefore fail the header check
instead of issuing collectives of different sizes (gloo aborts the process on those, NCCL hangs).
The size grows only through a blocking handshake whose outcome every rank sees.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .recipe import DelayedScaling, fp8_max
from .scaling import DIGEST_PRIME, ScalingStorage, bits_mod_p, update_scaling

__all__ = [
    "AmaxGroup",
    "AmaxReductionError",
    "Channel",
    "Direction",
    "HEADER_FIELDS",
    "HEADER_LEN",
    "LayoutMismatchError",
    "PendingReduction",
    "ReductionStats",
    "StateMismatchError",
]

# Each header quantity q is sent as (q, -q), so one MAX reveals the group's max and min of it.
HEADER_FIELDS = (
    "layout_hi",  # two 24-bit halves of the layout fingerprint: direction, recipe, modules in
    "layout_lo",  # order and the roles that recorded
    "roles",
    "modules",
    "roles_recorded",
    "training_region",  # the amax group's own index of the region these amaxes belong to
    "wire",  # values this rank sends after the header
    "state_hi",  # two 24-bit digests of the scales and amax histories: ranks must hold the same
    "state_lo",  # FP8 state
)
HEADER_LEN = 2 * len(HEADER_FIELDS)
_STATE_FIELDS = {"state_hi", "state_lo"}
# Amaxes every collective can carry from the start (16 KiB with the header), so that a model of up to
# that many roles per direction never needs a blocking size handshake (section 3: a pipeline stage
# must not block at its region's exit); more grows the size once, with a handshake.
INITIAL_WIRE = 4096
VERDICT_LAG = {"cuda": 8}  # launches between folding a verdict on the device and reading it on the host


class LayoutMismatchError(RuntimeError):
    """Ranks of an amax group contributed different FP8 roles or steps; no scale was updated."""


class StateMismatchError(LayoutMismatchError):
    """Ranks of an amax group agree on the layout but hold different FP8 scales (e.g. a load on one rank)."""


class AmaxReductionError(RuntimeError):
    """An amax all-reduce failed or timed out (a rank died or stalled); no scale was updated from it."""


def _callable_key(fn) -> str:
    """Text that is the same in every process for the same callable, and differs for different ones.

    Functions (lambdas and closures included) are known by their code, constants and the values they
    close over; `functools.partial` by its function and arguments; other callables by their type.
    Memory addresses, which differ between processes, are left out."""
    if isinstance(fn, functools.partial):
        return f"partial({_callable_key(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    code = getattr(fn, "__code__", None)
    if code is None:
        return f"{type(fn).__module__}.{type(fn).__qualname__}"
    closure = [cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ())]
    details = repr((code.co_consts, code.co_names, getattr(fn, "__defaults__", None), closure))
    details = re.sub(r"0x[0-9a-fA-F]+", "0x", details)
    digest = hashlib.blake2b(code.co_code + details.encode(), digest_size=6).hexdigest()
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}#{digest}"


def recipe_key(recipe: DelayedScaling) -> str:
    """The recipe fields every rank must agree on, as text that is the same in every process."""

    def name(algo) -> str:
        return repr(algo) if algo is None or isinstance(algo, str) else _callable_key(algo)

    return (
        f"margin={recipe.margin}, fp8_format={recipe.fp8_format.name}, "
        f"amax_history_len={recipe.amax_history_len}, amax_compute_algo={name(recipe.amax_compute_algo)}, "
        f"scaling_factor_compute_algo={name(recipe.scaling_factor_compute_algo)}"
    )


@dataclass
class Mark:
    """A point in time where the work that waits runs: the host clock on the CPU, an event on the
    current stream on CUDA (where `work.wait()` makes the stream wait and returns at once)."""

    def __init__(self, device: torch.device) -> None:
        self.event = None
        self.host = time.perf_counter()
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()


class ReductionStats:
    """Per-process counters, readable through `fp8train.reduction_stats()` (docs/telemetry.md).

    `exposed_wait_s`: time the waiting side stood still for a collective (the host on the CPU; the
    compute stream on CUDA, measured with events). `hidden_s`: time from a launch to the start of its
    wait on the same clock, during which the collective overlapped other work."""

    def __init__(self) -> None:
        self.launched = 0
        self.bytes_reduced = 0
        self.exposed_wait_s = 0.0
        self.hidden_s = 0.0
        self.updates = 0
        self.nonfinite_amax_events = 0
        self._nonfinite: dict = {}  # device -> (count on the device, its HostMirror)
        self._intervals: collections.deque = collections.deque()  # CUDA event pairs not read yet

    def add_interval(self, name: str, start: Mark, end: Mark) -> None:
        if start.event is None:
            setattr(self, name, getattr(self, name) + end.host - start.host)
        else:
            self._intervals.append((name, start.event, end.event))

    def count_nonfinite(self, last: torch.Tensor, ok: Optional[torch.Tensor]) -> None:
        count = torch.isinf(last).sum()
        if ok is not None:
            count = count * ok
        if last.device not in self._nonfinite:
            total = torch.zeros((), dtype=torch.int64, device=last.device)
            self._nonfinite[last.device] = (total, HostMirror(total))
        total, mirror = self._nonfinite[last.device]
        total += count
        mirror.publish(total)

    def _read_intervals(self, block: bool) -> None:
        while self._intervals:
            name, start, end = self._intervals[0]
            if not end.query():
                if not block:
                    return
                end.synchronize()
            setattr(self, name, getattr(self, name) + start.elapsed_time(end) / 1e3)
            self._intervals.popleft()

    def as_dict(self, wait: bool = True) -> dict:
        """The counters. `wait=False` reads nothing that would wait for a device: CUDA timings and
        non-finite counts not on the host yet are left for a later read."""
        self._read_intervals(block=wait)
        self.nonfinite_amax_events = sum(
            int(mirror.wait() if wait else mirror.host) for _, mirror in self._nonfinite.values()
        )
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class HostMirror:
    """A host copy of a small device tensor, refreshed by copies the host never waits for.

    `host` holds the copy as it stands: for a scalar, the newest value whose copy has arrived, which
    is all a sticky flag or a growing count needs. `ready()` says whether the latest copy arrived;
    `wait()` (for host points) waits for it. On the CPU every copy arrives at once."""

    def __init__(self, like: torch.Tensor) -> None:
        cuda = like.is_cuda
        self.host = torch.zeros(like.shape, dtype=like.dtype, pin_memory=cuda)
        self.host._fp8train_host_mirror = True  # host memory: reading it never waits for the device
        self.event = torch.cuda.Event() if cuda else None

    def publish(self, value: torch.Tensor) -> None:
        self.host.copy_(value, non_blocking=True)
        if self.event is not None:
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class StickyFlag:
    """A failure flag set on the device; the host reads it through a `HostMirror`."""

    def __init__(self, device: torch.device) -> None:
        self.value = torch.zeros((), dtype=torch.bool, device=device)
        self.mirror = HostMirror(self.value)

    def set_where(self, failed: torch.Tensor) -> None:
        self.value |= failed
        self.mirror.publish(self.value)


class Channel:
    """The amax all-reduces on one process group: their common size, and whether one went wrong.

    A failed check anywhere on the channel stops every later update on it (the flag is checked on the
    device by every reduction): after a mismatch, collectives may be paired with the wrong partners.

    When to raise is decided by launch count alone, so that every rank raises at the same launch
    whatever the timing of its device: launch k raises if a reduction launched at k - 2 or earlier
    (finished by then in a normal loop; waited for otherwise) disagreed. The disagreements are folded
    on the device into `verdict`, whose host copy is read VERDICT_LAG launches later (at once on the
    CPU; on CUDA the copy has long arrived by then, so the read does not stall the host).
    """

    def __init__(self, process_group) -> None:
        self.process_group = process_group
        self.agreed = INITIAL_WIRE  # values after the header, agreed by every rank (in a handshake)
        self.directions: list[Direction] = []
        self.flag: Optional[StickyFlag] = None
        self.failure: Optional[torch.Tensor] = None  # [direction, reduced header, local header]
        self.error: Optional[LayoutMismatchError] = None
        self.launches = 0
        self.unfolded: collections.deque[tuple[int, Direction]] = collections.deque()  # launched, not folded
        self.disagreed: dict[int, torch.Tensor] = {}  # launch index -> the ranks' headers differed (device)
        self.verdict: Optional[torch.Tensor] = None  # a folded reduction disagreed (device bool)
        self.verdicts: collections.deque[tuple[int, HostMirror]] = collections.deque()  # copies on their way
        self._spare: Optional[HostMirror] = None  # a verdict copy read already, for reuse

    def attach(self, direction: Direction, device: torch.device) -> None:
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
        self, reduced: torch.Tensor, local: torch.Tensor, direction: Direction, index: int = -1
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

    def begin_launch(self, direction: Direction) -> int:
        """Decide whether this launch raises (the same decision on every rank: see the class docstring),
        and return its index."""
        self.check()
        self.launches += 1
        index = self.launches
        while self.unfolded and self.unfolded[0][0] <= index - 2:
            done, owner = self.unfolded.popleft()
            if done not in self.disagreed:
                owner.finish()  # not finished yet (no FP8 call used it): wait for it now
            if done in self.disagreed:  # (absent only when a failure already stopped the updates)
                self.verdict |= self.disagreed.pop(done)
        mirror = self._spare or HostMirror(self.verdict)
        mirror.publish(self.verdict)
        self.verdicts.append((index, mirror))
        due, oldest = self.verdicts[0]
        if due <= index - VERDICT_LAG.get(self.verdict.device.type, 0):
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
        direction = self.directions[int(values[0])]
        reduced, local = values[1 : 1 + HEADER_LEN], values[1 + HEADER_LEN :]
        differing = [name for i, name in enumerate(HEADER_FIELDS) if reduced[2 * i] != -reduced[2 * i + 1]]
        rank = dist.get_rank() if dist.is_initialized() else 0
        if differing and set(differing) <= _STATE_FIELDS:
            return StateMismatchError(
                f"FP8 state differs between ranks of the {direction.name} amax group (rank {rank}, "
                f"{direction.describe()}): the ranks run the same modules but hold different scales or "
                "amax histories, so they would train with different FP8 casts. This happens when a "
                "checkpoint was loaded on some ranks only (for example rank 0 loads it, then DDP "
                "broadcasts parameters and buffers, but not FP8 state). Fix: after loading, call "
                "fp8train.broadcast_fp8_state(model, src=0) on every rank, or load the checkpoint on "
                "every rank. No scale was updated from this reduction."
            )
        spans = [
            f"{name}: this rank {int(local[2 * i])}, group min {int(-reduced[2 * i + 1])} "
            f"max {int(reduced[2 * i])}"
            for i, name in enumerate(HEADER_FIELDS)
            if name in differing and not name.startswith(("layout", "state"))
        ]
        return LayoutMismatchError(
            f"FP8 layout mismatch in the {direction.name} amax group (rank {rank}): ranks contributed "
            "different modules, order or sizes, a module or a backward ran on some ranks only, ranks ran "
            "different numbers of training regions, or ranks use different recipes. Differing: "
            f"{', '.join(differing)}{'; ' if spans else ''}{'; '.join(spans)}. This rank has "
            f"{direction.describe()} and recipe ({direction.recipe_key}). Every rank of the amax group "
            "must run the same FP8 modules in the same order under the same recipe, in the same training "
            "regions; no scale was updated. An amax group must not span pipeline stages: give each stage "
            "its own amax group (fp8_group = the data- and tensor-parallel ranks of that stage)."
        )


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


def state_digest(storage: ScalingStorage, weights: torch.Tensor) -> torch.Tensor:
    """Two 24-bit digests (float32) of a direction's scales, inverse scales and history digests.

    Integer arithmetic modulo a prime: exact and identical on every device for the same bits."""
    parts = torch.stack([bits_mod_p(storage.scale), bits_mod_p(storage.scale_inv), storage.digest])
    return ((weights * parts.unsqueeze(0)) % DIGEST_PRIME).sum(dim=(1, 2)).remainder(DIGEST_PRIME).float()


def _digest_weights(n: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0x5EED)
    return torch.randint(1, 2**24, (2, 3, n), generator=generator, dtype=torch.int64).to(device)


class Direction:
    """One direction ("fwd" or "bwd") of an amax group: contiguous state, recording, reductions."""

    def __init__(
        self, name: str, recipe: DelayedScaling, channel: Optional[Channel], stats: ReductionStats
    ) -> None:
        self.name = name
        self.recipe = recipe
        self.channel = channel  # None: nothing to reduce (one rank, or reduce_amax=False)
        self.stats = stats
        self.encoding = recipe.fp8_format.fwd if name == "fwd" else recipe.fp8_format.bwd
        self.fp8_max = fp8_max(self.encoding)
        self.storage: Optional[ScalingStorage] = None
        self.members: list[str] = []  # signature of each registered module, in order
        # The recipe seeds the layout fingerprint: ranks with different recipes (margin, history
        # length, algorithms) would otherwise reduce happily and silently compute different scales.
        self.recipe_key = recipe_key(recipe)
        self._layout = hashlib.blake2b(f"{name} {self.recipe_key}".encode(), digest_size=8).digest()
        self._recording_task = -1  # autograd graph task of the amaxes in the recording slot
        self.recorded_columns: list[int] = []
        self.pending: collections.deque[PendingReduction] = collections.deque()
        self._static_headers: dict[tuple, torch.Tensor] = {}  # recorded columns -> header fields 0-4
        self._weights: Optional[torch.Tensor] = None  # state digest weights for the current size
        self.group: Optional[AmaxGroup] = None  # set by the AmaxGroup that holds this direction

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
        self._layout = hashlib.blake2b(self._layout + signature.encode(), digest_size=8).digest()
        self._static_headers.clear()
        self._weights = None
        return self.storage.append(history, scale, scale_inv)

    def describe(self) -> str:
        head = ", ".join(self.members[:6]) + (", ..." if len(self.members) > 6 else "")
        roles = self.storage.num_roles if self.storage is not None else 0
        return f"{len(self.members)} modules / {roles} {self.name} roles [{head}]"

    # ---- recording ------------------------------------------------------------------------------
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
        """Forget amaxes of a region that failed; what is launched for it is then empty."""
        if self.storage is not None:
            self.storage.recording.zero_()
        self.recorded_columns.clear()

    # ---- the collective -------------------------------------------------------------------------
    def launch(self, async_op: bool, region_index: int) -> None:
        """Snapshot and clear the recording slot, then start the MAX all-reduce on the snapshot."""
        storage = self.storage
        n = storage.num_roles
        columns = tuple(sorted(set(self.recorded_columns)))
        self.recorded_columns.clear()
        channel = self.channel
        if channel is None:
            snapshot = storage.recording.clone()
            storage.recording.zero_()
            snapshot.masked_fill_(torch.isnan(snapshot), float("inf"))  # as if it had been reduced
            self.pending.append(PendingReduction(snapshot, [], n, Mark(snapshot.device)))
            return
        index = channel.begin_launch(self)  # raises on every rank alike; no further collective then
        self.finish()  # the state digest must cover every earlier update (normally already applied)
        agreed = channel.agreed
        wire = max(n, agreed)
        buffer = torch.zeros(HEADER_LEN + wire, device=storage.device)
        amaxes = buffer[HEADER_LEN : HEADER_LEN + n]
        amaxes.copy_(storage.recording)
        storage.recording.zero_()
        amaxes.masked_fill_(torch.isnan(amaxes), float("inf"))  # NCCL's MAX may drop NaN
        header = self._header(columns, region_index, wire)
        buffer[:HEADER_LEN].copy_(header)
        pending = PendingReduction(buffer, [], n, None, header, index=index)
        if wire == agreed:
            pending.works.append(self._all_reduce(buffer, async_op))
            pending.launched_at = Mark(buffer.device)
        else:
            # The layout grew: settle the header first (blocking, checked on the host), so that ranks
            # never issue collectives of different sizes, then reduce the new values.
            pending.buffer = buffer[: HEADER_LEN + agreed]
            pending.extra = buffer[HEADER_LEN + agreed :].clone()
            self._all_reduce(pending.buffer, async_op=False)
            if not bool(channel.agrees(pending.buffer[:HEADER_LEN], header, self)):
                channel.check(block=True)
            channel.agreed = wire
            pending.works.append(self._all_reduce(pending.extra, async_op))
            pending.launched_at = Mark(buffer.device)
        self.pending.append(pending)

    def _header(self, columns: tuple, region_index: int, wire: int) -> torch.Tensor:
        """This rank's header, written on the device: no host-to-device copy in a steady step."""
        static = self._static_headers.get(columns)
        device = self.storage.device
        if static is None:  # a new layout or set of recorded roles: once, not every step
            digest = hashlib.blake2b(self._layout + repr(columns).encode(), digest_size=6).digest()
            values = [
                int.from_bytes(digest[:3], "little"),
                int.from_bytes(digest[3:], "little"),
                self.storage.num_roles,
                len(self.members),
                len(columns),
            ]
            static = self._static_headers[columns] = torch.tensor(values, dtype=torch.float32, device=device)
        if self._weights is None:
            self._weights = _digest_weights(self.storage.num_roles, device)
        dynamic = torch.full((2,), float(region_index % 2**24), device=device)
        dynamic[1] = wire
        q = torch.cat([static, dynamic, state_digest(self.storage, self._weights)])
        return torch.stack([q, -q], dim=1).flatten()

    def _all_reduce(self, buffer: torch.Tensor, async_op: bool):
        """Start the collective; in blocking mode complete it here and count it all as exposed."""
        self.stats.launched += 1
        self.stats.bytes_reduced += buffer.numel() * buffer.element_size()
        start = Mark(buffer.device)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.channel.process_group, async_op=True)
        if async_op:
            return work
        self._wait_work(work)
        self.stats.add_interval("exposed_wait_s", start, Mark(buffer.device))
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
        """Wait for every launched reduction, check it on the device, then run the fused update."""
        while self.pending:
            pending = self.pending.popleft()
            if self.channel is not None and self.channel.error is not None:
                continue  # after a mismatch the collectives may be mispaired: apply nothing more
            self._wait(pending)
            n = pending.num_roles
            ok = None
            last = pending.buffer[:n]
            if pending.header is not None:
                amaxes = pending.buffer[HEADER_LEN:]
                if pending.extra is not None:
                    amaxes = torch.cat([amaxes, pending.extra])
                last = amaxes[:n]
                ok = self.channel.agrees(pending.buffer[:HEADER_LEN], pending.header, self, pending.index)
            storage = self.storage
            self.stats.updates += 1
            self.stats.count_nonfinite(last, ok)
            update_scaling(
                storage.history[:, :n],
                storage.scale[:n],
                storage.scale_inv[:n],
                last,
                self.recipe,
                self.fp8_max,
                ok,
                storage.digest[:n],
            )

    def check(self, block: bool = False) -> None:
        """Raise a mismatch seen on this direction's process group (without waiting, unless `block`)."""
        if self.channel is not None:
            self.channel.check(block)

    def _wait(self, pending: PendingReduction) -> None:
        works = [w for w in pending.works if w is not None]
        if works:
            start = Mark(pending.buffer.device)
            self.stats.add_interval("hidden_s", pending.launched_at, start)
            for work in works:
                self._wait_work(work)
            self.stats.add_interval("exposed_wait_s", start, Mark(pending.buffer.device))


class AmaxGroup:
    """The FP8 state the ranks of `process_group` share under `recipe`: both directions, and the
    index of the group's training regions (each group counts its own: other groups never shift it)."""

    def __init__(
        self, recipe: DelayedScaling, process_group, channel: Optional[Channel], stats: ReductionStats
    ) -> None:
        self.recipe = recipe
        self.process_group = process_group
        self.fwd = Direction("fwd", recipe, channel, stats)
        self.bwd = Direction("bwd", recipe, channel, stats)
        self.fwd.group = self.bwd.group = self
        self.training_regions = 0
        self.latest_region = None  # the latest region that launched its forward reduction

    def next_region_index(self) -> int:
        index = self.training_regions
        self.training_regions += 1
        return index

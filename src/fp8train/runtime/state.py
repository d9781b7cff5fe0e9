"""What the protocol keeps between calls, and its one owner (docs/design.md, section 3).

`STATE` is the one process-wide state of fp8train. It is composed of one owner per concern, each
changed through its own methods only: the region stack (active `fp8_autocast` settings, the
outermost region, the live regions by serial), the amax groups (and the channel of each process
group, and the reduction counters), the FP8 modules by handle, each module's current call, the
running backward pass, the per-step boundary, and the activation recomputations being noted or
replayed. `STATE.reset()` (tests, benchmarks: `fp8train.inspection.reset`) makes every owner afresh
but the module handles, which compiled graphs hold.

The objects the owners hold are defined here too (a region, a backward pass, a module call's plan),
so that the protocol's files import this one and it imports none of them.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol

import torch

from ..torch_internals import at_end_of_backward, current_graph_task
from ..amax.channel import Channel
from ..amax.membership import reduces_across_ranks, world_if_default
from ..amax.reduction import AmaxGroup, Direction
from ..amax.stats import ReductionStats

if TYPE_CHECKING:
    from ..recipe import Recipe

__all__ = [
    "STATE", "State", "KEPT_REGIONS", "RecipeQuantization", "RegionSettings", "Region", "BackwardPass",
    "ForwardPlan", "FrozenScales",
]  # fmt: skip

KEPT_REGIONS = 64  # the most recent regions stay alive for the backward nodes that name them


# ---- what the owners hold -------------------------------------------------------------------------------
class RecipeQuantization(Protocol):
    """What the protocol, and the readers of a region's settings, read of a recipe's `Quantization`
    (quantization/base.py, a layer above: the protocol names the facts here instead of importing it)."""

    recipe: Recipe
    kind: str  # a module trains under one kind
    reduces_amax: bool  # delayed scaling: amax groups, plans with frozen scales
    casts_before_gather: bool  # FSDP2 weights gathered as FP8 bytes
    whole_blocks: int  # GEMM dimensions are multiples of it


@dataclass(frozen=True)
class RegionSettings:
    """One fp8_autocast entry's arguments, with its recipe's quantization."""

    enabled: bool
    calibrating: bool
    recipe: Recipe
    quantization: RecipeQuantization  # the recipe's Quantization (quantization/)
    # delayed scaling in an active region: its amax group, looked up once at entry (regions.py); None else
    amax_group: Optional[AmaxGroup] = None

    @property
    def active(self) -> bool:
        """FP8 casts or amax recording happen in this region."""
        return self.enabled or self.calibrating

    @property
    def group(self):
        """The amax group's process group (asked of the amax group, its one owner); None where there is
        no amax group (no delayed scaling, or an inactive region)."""
        return None if self.amax_group is None else self.amax_group.process_group


class FrozenScales:
    """A direction's scales frozen for a region (a copy): [scale; scale_inv] as one 2 x N tensor, made
    in one op, and what every GEMM of the region reads from it, made once for all of them (the lean
    path, docs/design.md, section 6): each GEMM's [[x, w], [x_inv, w_inv]] block (a view), and each
    column's scale and scale_inv as 0-dim views (two unbinds for the region, where each cast would
    select its own)."""

    __slots__ = ("stacked", "scale", "scale_inv", "_columns", "_blocks")

    def __init__(self, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self.stacked = torch.stack([scale, scale_inv])
        self.scale, self.scale_inv = self.stacked.unbind()
        self._columns: Optional[tuple[tuple, tuple]] = None
        self._blocks: dict[int, tuple[torch.Tensor, tuple]] = {}

    def gemm(self, base: int) -> tuple[torch.Tensor, tuple]:
        """The block [[x, w], [x_inv, w_inv]] of the GEMM whose input's column is `base` (its weight's
        is base + 1), and its casts' ((x, x_inv), (w, w_inv)), as views of the frozen copy."""
        try:
            return self._blocks[base]
        except KeyError:
            pass
        if self._columns is None:
            self._columns = (self.scale.unbind(), self.scale_inv.unbind())
        scales, inverses = self._columns
        block = self.stacked[:, base : base + 2]
        pairs = ((scales[base], inverses[base]), (scales[base + 1], inverses[base + 1]))
        self._blocks[base] = block, pairs
        return block, pairs


@dataclass
class ForwardPlan:
    """The plan of one module's forward call (not a GEMM call: calls.Call; not a checkpoint call:
    plans.CheckpointRecord).

    How one forward call of an FP8 module runs (made at its first GEMM, calls.py), and what its
    backward owes the protocol; a training call's plan is noted in its region for recomputation."""

    fp8: bool
    quantization: RecipeQuantization  # the recipe's Quantization
    region: Optional[Region] = None  # an FP8 training call: the region whose backward it owes
    serial: int = -1  # that region's serial, also in a replay (which holds no reference to it)
    # delayed scaling only (quantization.reduces_amax):
    scale: Optional[torch.Tensor] = None  # forward scales of the module's group (a frozen snapshot)
    scale_inv: Optional[torch.Tensor] = None
    offset: int = 0  # the module's first column in its group's forward storage
    records_into: Optional[Direction] = None  # forward amaxes go here (None: record nothing)
    frozen: Optional[FrozenScales] = None  # the region's frozen scales, when scale and scale_inv are its
    # the latest GEMM's scales as `Call.forward_scales` gave them: (block, its casts' pairs or None,
    # its (input, weight) columns), for the call's `for_gemm` and `record_amax` (they serve only while
    # the call's scales are the block given)
    given: Optional[tuple] = None

    def replay(self) -> ForwardPlan:
        """The plan as a recomputation replays it: same scales, no amax recorded, no region held."""
        return ForwardPlan(
            self.fp8, self.quantization, None, self.serial, self.scale, self.scale_inv, self.offset,
            frozen=self.frozen,
        )  # fmt: skip


class Region:
    """One outermost fp8_autocast entry: the amax groups it trained, and its forward calls."""

    def __init__(self, serial: int, async_op: bool) -> None:
        self.serial = serial
        self.async_op = async_op
        self.grad_at_entry = torch.is_grad_enabled()
        self.trained: dict[AmaxGroup, int] = {}  # groups in the order they first trained -> index
        self.snapshots: dict[Direction, FrozenScales] = {}  # frozen (scale, scale_inv)
        self._token: Optional[torch.Tensor] = None
        # (device, tokens, out, in) -> (GEMM path, operand dtype) of its training calls, decided at the
        # first (modules/fp8_linear.py): the settings it reads hold for the region
        self.gemm_paths: dict[tuple, tuple] = {}
        # module id -> replays of its training calls
        self.calls: dict[int, collections.deque[ForwardPlan]] = {}
        self.outputs: list[weakref.ref] = []  # autograd nodes of its FP8 training calls' outputs
        self.compiled_calls = False  # training calls from a compiled graph, whose outputs are not seen
        self.backward_done = False

    def owes_backward(self) -> bool:
        """Its backward has not run and its graph is alive (a dropped graph owes nothing)."""
        if self.backward_done:
            return False
        # no node: no call produced a graph (frozen layers), unless a compiled graph made the calls
        return self.compiled_calls or any(node() is not None for node in self.outputs)

    def note_trained(self, group: AmaxGroup) -> None:
        """`group` recorded amaxes here for training (once a module is a member: it can launch)."""
        self.trained.setdefault(group, -1)

    def note_training_call(self, module_id: int, replay: ForwardPlan, compiled: bool = False) -> None:
        """A training call ran (again, when a backward ran inside the region): its backward is owed,
        and a recomputation may replay it."""
        self.backward_done = False
        self.calls.setdefault(module_id, collections.deque()).append(replay)
        self.compiled_calls |= compiled

    def note_output(self, node) -> None:
        self.outputs.append(weakref.ref(node))

    def backward_ran(self) -> None:
        self.backward_done = True
        self.calls.clear()

    def index_of(self, group: AmaxGroup) -> int:
        """This region's index among `group`'s training regions (taken by its first launch)."""
        if self.trained[group] < 0:
            self.trained[group] = group.next_region_index()
        return self.trained[group]

    def scales_for(self, direction: Direction) -> FrozenScales:
        """The scales this region uses for `direction`: finished once, then frozen (a copy)."""
        snap = self.snapshots[direction] if direction in self.snapshots else None
        if snap is None or snap.scale.shape[0] != direction.storage.scale.shape[0]:
            direction.finish()
            direction.check()
            snap = FrozenScales(direction.storage.scale, direction.storage.scale_inv)
            self.snapshots[direction] = snap
        return snap

    @property
    def token(self) -> torch.Tensor:
        """Its serial as a host int64 scalar: names the region to the backward of its training calls
        (saved with each; made once)."""
        if self._token is None:
            self._token = _host_scalar(self.serial)
        return self._token


def _host_scalar(value: int) -> torch.Tensor:
    token = torch.tensor(value)
    token._fp8train_host_mirror = True  # host memory by design: reading it never waits for a device
    return token


class BackwardPass:
    """What one backward pass (an autograd graph task) recorded: launched when the pass ends.

    Each group's reduction carries the index of the region whose backward recorded into it first in
    the pass, so a rank that ran a backward its peers did not (or in another order) fails the check.
    """

    def __init__(self, step: StepBoundary) -> None:
        self.step = step
        self.groups: dict[AmaxGroup, Region] = {}  # group -> the first region that recorded into it
        self.regions: dict[Region, None] = {}

    def note(self, group: Optional[AmaxGroup], region: Optional[Region]) -> None:
        if region is None:  # its region was collected: it cannot be named, the group's latest stands in
            region = group.latest_region
        if group is not None:  # None: a recipe that reduces nothing
            self.groups.setdefault(group, region)
        self.regions[region] = None

    def end(self) -> None:
        for group, region in self.groups.items():
            if group.recipe.per_step:  # kept for the step boundary (steps.py)
                group.bwd.accumulate()
                self.step.note_group(group)
            elif group.bwd.recorded_columns:
                group.bwd.launch(region.async_op, region.index_of(group))
        for region in self.regions:
            region.backward_ran()


# ---- the owners -------------------------------------------------------------------------------------------
class RegionStack:
    """The active fp8_autocast settings (innermost last), the outermost region, the live regions."""

    def __init__(self) -> None:
        self.stack: list[RegionSettings] = []
        self.region: Optional[Region] = None  # the outermost region being run
        self._by_serial: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()
        self._recent: collections.deque[Region] = collections.deque(maxlen=KEPT_REGIONS)
        self.entered = 0  # serial of the latest outermost region

    @property
    def settings(self) -> Optional[RegionSettings]:
        """The innermost active region's settings (None outside every region)."""
        return self.stack[-1] if self.stack else None

    def push(self, settings: RegionSettings, region: Optional[Region]) -> None:
        self.stack.append(settings)
        if region is not None:
            self.entered = region.serial
            self.region = region
            self._by_serial[region.serial] = region
            self._recent.append(region)

    def pop(self, region: Optional[Region]) -> None:
        self.stack.pop()
        if region is not None:
            self.region = None

    def live(self) -> list[Region]:
        return list(self._by_serial.values())

    def by_serial(self, serial: int) -> Optional[Region]:
        return self._by_serial.get(serial)

    @contextlib.contextmanager
    def replaced(self, stack: tuple[RegionSettings, ...]) -> Iterator[None]:
        """The settings of `stack` in force (a recomputation replays under its original regions)."""
        saved, self.stack = self.stack, list(stack)
        try:
            yield
        finally:
            self.stack = saved


class AmaxGroups:
    """The amax groups, the channel of each process group, and their reduction counters."""

    def __init__(self) -> None:
        self.groups: dict[tuple, AmaxGroup] = {}
        self._last: Optional[tuple] = None  # (recipe, process group, its group): `of`'s last answer
        self.channels: dict[object, Channel] = {}
        self.stats = ReductionStats()

    def of(self, recipe, process_group) -> AmaxGroup:
        """The amax group of `recipe` (a DelayedScaling) on `process_group` (None: the world). The last
        answer is kept for the same two objects (every FP8 call of a region asks it)."""
        process_group = world_if_default(process_group)
        last = self._last
        if last is not None and last[0] is recipe and last[1] is process_group:
            return last[2]
        group = self._of(recipe, process_group)
        self._last = (recipe, process_group, group)
        return group

    def _of(self, recipe, process_group) -> AmaxGroup:
        # recipes equal as the header sees them (callables by their code) share a group
        key = (recipe.key(), recipe.reduce_amax, process_group)
        group = self.groups.get(key)
        if group is None:
            channel = None
            if reduces_across_ranks(recipe, process_group):
                channel = self.channels.setdefault(process_group, Channel())
            group = self.groups[key] = AmaxGroup(recipe, process_group, channel, self.stats)
        return group

    def synchronize(self) -> None:
        """Complete every in-flight amax reduction and apply it, then raise any mismatch. No collective."""
        for group in self.groups.values():
            group.fwd.finish()
            group.bwd.finish()
        for channel in self.channels.values():
            channel.check(block=True)


class ModuleHandles:
    """FP8 modules by handle: how the protocol's custom ops name them (never reset)."""

    def __init__(self) -> None:
        self._count = 0
        self._modules: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()

    def register(self, module: torch.nn.Module) -> torch.Tensor:
        """A new handle for `module`, in eager code and in compiled graphs. A host int64 scalar rather
        than an int: a graph takes a tensor attribute as an input, so one graph serves every module of
        a kind, where dynamo would guard an int attribute's value and compile once per module (a
        model's blocks compiled one by one)."""
        self._count += 1
        self._modules[self._count] = module
        handle = torch.tensor(self._count, dtype=torch.int64, device="cpu")
        handle._fp8train_host_mirror = True  # host memory by design: reading it never waits for a device
        return handle

    def module(self, handle: torch.Tensor) -> torch.nn.Module:
        return self._modules[int(handle)]


class CurrentPlans:
    """Each module's current forward call's `ForwardPlan` (not its GEMM calls, which are made from it):
    made at its first GEMM, for its later GEMMs, the custom ops of a compiled graph and readers
    (coverage, tensor statistics)."""

    def __init__(self) -> None:
        self._plans: weakref.WeakKeyDictionary[torch.nn.Module, Optional[ForwardPlan]] = (
            weakref.WeakKeyDictionary()
        )

    def of(self, module: torch.nn.Module) -> Optional[ForwardPlan]:
        return self._plans.get(module)

    def begin(self, module: torch.nn.Module, plan: Optional[ForwardPlan]) -> None:
        self._plans[module] = plan


class BackwardPasses:
    """The running backward pass's record, made (and its end queued) at its first FP8 backward node."""

    def __init__(self, step: StepBoundary) -> None:
        self._step = step
        self._current: Optional[tuple[int, BackwardPass]] = None  # (graph task, what it recorded)

    def current(self) -> BackwardPass:
        task = current_graph_task()
        if self._current is None or self._current[0] != task:
            record = BackwardPass(self._step)
            self._current = (task, record)
            at_end_of_backward(record.end)
        return self._current[1]


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


class Recomputation:
    """fp8train.checkpoint calls: those whose forward runs (they note the plans of its FP8 calls) and
    the one being recomputed (its plans are replayed)."""

    def __init__(self) -> None:
        self.replaying: Any = None  # the call being recomputed (plans.CheckpointRecord)
        self.noting: list = []  # calls whose forward is running

    @contextlib.contextmanager
    def noting_into(self, record) -> Iterator[None]:
        self.noting.append(record)
        try:
            yield
        finally:
            self.noting.remove(record)

    @contextlib.contextmanager
    def replay(self, record, regions: RegionStack) -> Iterator[None]:
        """While `record` is recomputed: the regions active at the original call, and its noted plans."""
        saved, self.replaying = self.replaying, record
        try:
            with regions.replaced(record.stack):
                yield
        finally:
            self.replaying = saved


class State:
    def __init__(self) -> None:
        self.handles = ModuleHandles()
        self.reset()

    def reset(self) -> None:
        """Forget every region, amax group, channel, call plan, counter and boundary; keep the handles."""
        self.regions = RegionStack()
        self.groups = AmaxGroups()
        self.calls = CurrentPlans()
        self.step = StepBoundary()
        self.backward = BackwardPasses(self.step)
        self.recompute = Recomputation()


STATE = State()

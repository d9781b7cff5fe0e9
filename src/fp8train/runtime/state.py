"""What the runtime keeps between calls, and its one owner (docs/design.md, sections 3 and 3.1).

`STATE` is the one process-wide state of fp8train. It is composed of one owner per concern, each
changed through its own methods only: the region stack (active `fp8_autocast` settings, the
outermost region, the live regions by serial), the FP8 modules by handle, each module's current call,
the running backward pass and the activation recomputations being noted or replayed; and the parts
that recipes attach (`State.attach`: delayed scaling's amax groups and step boundary, amax/state.py).
`STATE.reset()` (tests, benchmarks: `fp8train.inspection.reset`) makes every owner afresh and resets
every part, but the module handles, which compiled graphs hold.

The objects the owners hold are defined here too (a region, a backward pass, a module call's plan),
so that the runtime's files import this one and it imports none of them. Nothing here knows a
recipe: what a recipe keeps is reached through its hooks (`RecipeRuntime`, below).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterator, Optional, Protocol

import torch

from ..torch_internals import at_end_of_backward, current_graph_task

if TYPE_CHECKING:
    from ..recipe import Recipe

__all__ = [
    "STATE", "State", "KEPT_REGIONS", "RegionSettings", "Region", "BackwardPass", "ForwardPlan",
    "host_scalar", "host_int", "RecipeRuntime", "RecipeState", "RuntimeModule",
]  # fmt: skip

KEPT_REGIONS = 64  # the most recent regions stay alive for the backward nodes that name them


# ---- the runtime's contract with a recipe (docs/design.md, section 3.1) ----------------------------------
# The runtime (regions, calls, plans, recomputation, compiled ops) knows no recipe. At every point
# where a recipe may keep state it asks the recipe's quantization (`RecipeRuntime`, the base of
# `quantization.base.Quantization`), and the state objects that quantization hands it (`RecipeState`):
#
# - a region is entered: `region_state(settings, region, fp8_group)`, the recipe's state for the
#   entry, looked up once (delayed scaling: its amax group), kept in the settings pushed;
# - a module call is planned: `plan_call(module, settings, region, training)`, its `ForwardPlan`, and
#   under torch.compile `records(settings, training)` (the plan is then made at run time, by the op);
# - a training call's output is noted: `output_noted(plan, output)`;
# - a module is recomputed by plain torch.utils.checkpoint: `replays_alike(other)`, whether any of its
#   pending calls may stand for another;
# - a region exits: `RecipeState.exited(region, failed)` for each state a training call noted in it
#   (`Region.note_trained`);
# - a backward pass ends: `RecipeState.backward_ended(region)` for each state its GEMMs noted
#   (`BackwardPass.note`);
# - a compiled GEMM's scales, from the runtime's op: `gemm_scales(plan, gemm_index, ...)`;
# - readers: `frozen_scales(plan, gemm_index)`, the scales a GEMM casts with, recording nothing.
#
# The defaults are a stateless recipe's (each tensor scaled from itself): nothing kept, nothing owed
# but the backward a training call's region waits for. Delayed scaling's state answers them in
# `amax/` (`amax.DelayedRuntime`); the step boundary (`fp8train.end_step`) is its own.


class RuntimeModule(Protocol):
    """What the runtime reads of an FP8 module (modules/base.py's `FP8Module`, a layer above): named
    here, where the runtime calls it, instead of imported."""

    signature: str  # names it in errors
    recipe_kind: Optional[str]  # the recipe kind it trains under (None: none yet)
    fp8_handle: torch.Tensor  # how the compiled ops name it (`ModuleHandles.register`)

    def claim_recipe_kind(self, kind: str) -> None:
        """Train under `kind` from now on; raises where the module trained under another."""


class RecipeState(Protocol):
    """What a recipe keeps across regions and backward passes (delayed scaling: an amax group), as the
    runtime sees it: told when a region that trained it exits and when a backward pass that recorded
    into it ends."""

    process_group: object  # the ranks that share it (None: this rank alone, or the world)
    latest_region: Optional[Region]  # stands in for a collected region in a backward pass

    def next_region_index(self) -> int:
        """The index of its next training region (a region takes one, at its first launch)."""

    def exited(self, region: Region, failed: bool) -> None:
        """`region`, in which it trained, exited (`failed`: by an exception)."""

    def backward_ended(self, region: Region) -> None:
        """A backward pass that recorded into it ended; `region`: the first region it recorded for."""


class RecipeRuntime:
    """A recipe's answers to the runtime (its `Quantization` inherits them): the stateless defaults."""

    recipe: Recipe
    kind: ClassVar[str]  # a module trains under one kind

    def region_entered(self) -> None:
        """A region with this recipe in force was entered (not a recomputation's replay): what the
        recipe reads once per region is read again (one object may serve many regions: a prepared
        model's, across pickling)."""

    def region_state(
        self, settings: RegionSettings, region: Optional[Region], fp8_group
    ) -> Optional[RecipeState]:
        """The recipe's state for a region entry with `settings` in force (active) and `fp8_group`,
        kept in the settings pushed (`RegionSettings.state`); None: the recipe keeps none. `region`:
        the outermost region entered or being run (None in a recomputation)."""
        return None

    def plan_call(
        self, module: RuntimeModule, settings: RegionSettings, region: Region, training: bool
    ) -> Optional[ForwardPlan]:
        """The plan of an FP8 module's forward call in `region` under `settings` (active); None: in
        high precision, recording nothing (a stateless recipe records nothing when calibrating)."""
        return ForwardPlan(True, self) if settings.enabled else None

    def records(self, settings: RegionSettings, training: bool) -> bool:
        """Whether a compiled call under `settings` (active) records amaxes."""
        return False

    def output_noted(self, plan: ForwardPlan, output: torch.Tensor) -> None:
        """An FP8 training call's output (with a graph), whose backward its region (`plan.region`)
        owes while the graph lives (`Region.note_output`); a recipe whose backward asks the runtime
        nothing also marks its region's backward as run on the output's node (for plain
        torch.utils.checkpoint's recomputations to find the regions still pending)."""
        region, node = plan.region, output.grad_fn
        region.note_output(node)
        node.register_hook(lambda *_: STATE.backward.current().note(None, region))

    def replays_alike(self, other: RecipeRuntime) -> bool:
        """Whether a pending call of `other` may be replayed for one of this recipe (a recomputation
        that cannot tell its original call apart): true where each tensor is scaled from itself."""
        return other.recipe == self.recipe

    def gemm_scales(
        self,
        plan: ForwardPlan,
        gemm_index: int,
        x_amax: Optional[torch.Tensor],
        w_amax: Optional[torch.Tensor],
        like: torch.Tensor,
        fresh: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record GEMM `gemm_index`'s amaxes in `plan`'s call; its scales [[x, w], [x_inv, w_inv]] and
        the token naming its region to its backward (`fresh`: new tensors, for the compiled op). Only
        a recipe with state has scales to give."""
        raise NotImplementedError(f"{type(self).__name__} keeps no scales: its tensors give their own")

    def frozen_scales(self, plan: ForwardPlan, gemm_index: int) -> Optional[torch.Tensor]:
        """[[x, w], [x_inv, w_inv]] that GEMM `gemm_index` of `plan`'s call casts with, recording
        nothing (readers: tensor statistics); None where the scales come from the tensors."""
        return None


# ---- what the owners hold -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegionSettings:
    """One fp8_autocast entry's arguments, with its recipe's quantization."""

    enabled: bool
    calibrating: bool
    recipe: Recipe
    quantization: RecipeRuntime  # the recipe's Quantization (quantization/), reached through its hooks
    # an active region: the recipe's state for it (delayed scaling: its amax group), looked up once at
    # entry (`RecipeRuntime.region_state`); None where the recipe keeps none
    state: Optional[RecipeState] = None

    @property
    def active(self) -> bool:
        """FP8 casts or amax recording happen in this region."""
        return self.enabled or self.calibrating

    @property
    def group(self):
        """The process group of the recipe's state (asked of the state, its one owner); None where there
        is none (a stateless recipe, or an inactive region)."""
        return None if self.state is None else self.state.process_group


@dataclass
class ForwardPlan:
    """The plan of one module's forward call (not a GEMM call: calls.Call; not a checkpoint call:
    plans.Replay).

    How one forward call of an FP8 module runs (made at its first GEMM by its recipe,
    `RecipeRuntime.plan_call`), and what its backward owes the runtime; a training call's plan is noted
    in its region for recomputation. A recipe with state extends it (delayed scaling: amax/state.py)."""

    fp8: bool
    quantization: RecipeRuntime  # the recipe's Quantization
    region: Optional[Region] = None  # an FP8 training call: the region whose backward it owes
    serial: int = -1  # that region's serial, also in a replay (which holds no reference to it)
    record: bool = False  # its GEMMs record amaxes (a recipe with state, training or calibrating)
    # a recipe with state: the latest GEMM's scales as it gave them, (scales, their casts' views
    # ((x, x_inv), (w, w_inv)) or None, what else the recipe keeps), for the GEMM's `Call.for_gemm`
    # (they serve only while its scales are those given)
    given: Optional[tuple] = None

    def replay(self) -> ForwardPlan:
        """The plan as a recomputation replays it: the same casts, nothing recorded, no region held."""
        return ForwardPlan(self.fp8, self.quantization, None, self.serial)

    def same_as(self, other: ForwardPlan) -> bool:
        """Whether a recomputation of `other`'s call may take this plan instead (the same casts)."""
        return self.fp8 == other.fp8


class Region:
    """One outermost fp8_autocast entry: the recipe states it trained, and its forward calls."""

    def __init__(self, serial: int) -> None:
        self.serial = serial
        # whether the reductions it launches are asynchronous: set by the first recipe state that needs
        # to know, at its entry (delayed scaling: NVTE_ASYNC_AMAX_REDUCTION); None: none did
        self.async_op: Optional[bool] = None
        self.grad_at_entry = torch.is_grad_enabled()
        # recipe states (amax groups) in the order they first trained here -> this region's index in each
        self.trained: dict[RecipeState, int] = {}
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

    def note_trained(self, state: RecipeState) -> None:
        """`state` recorded amaxes here for training: told when the region exits."""
        self.trained.setdefault(state, -1)

    def note_training_call(self, module_id: int, replay: ForwardPlan, compiled: bool = False) -> None:
        """A training call ran (again, when a backward ran inside the region): its backward is owed,
        and a recomputation may replay it."""
        self.backward_done = False
        calls = self.calls.get(module_id)
        if calls is None:  # (no setdefault: it would make a deque at every call)
            calls = self.calls[module_id] = collections.deque()
        calls.append(replay)
        self.compiled_calls |= compiled

    def note_output(self, node) -> None:
        self.outputs.append(weakref.ref(node))

    def backward_ran(self) -> None:
        self.backward_done = True
        self.calls.clear()

    def index_of(self, state: RecipeState) -> int:
        """This region's index among `state`'s training regions (taken by its first launch)."""
        if self.trained[state] < 0:
            self.trained[state] = state.next_region_index()
        return self.trained[state]

    @property
    def token(self) -> torch.Tensor:
        """Its serial as a host int64 scalar: names the region to the backward of its training calls
        (saved with each; made once)."""
        if self._token is None:
            self._token = host_scalar(self.serial)
        return self._token


def host_scalar(value: int) -> torch.Tensor:
    """`value` as a host int64 scalar, marked as host memory by design (never a device wait); its
    value is kept beside it for `host_int`."""
    token = torch.tensor(value)
    token._fp8train_host_mirror = True  # host memory by design: reading it never waits for a device
    token._fp8train_int = value
    return token


def host_int(scalar: torch.Tensor) -> int:
    """The value of a host int64 scalar: as `host_scalar` (or `ModuleHandles.register`) kept it beside
    the tensor, which nothing writes (the lean path: `int()` is an aten call, `_local_scalar_dense`,
    two per backward GEMM), else `int()` (another tensor: a compiled graph's)."""
    try:
        return scalar._fp8train_int
    except AttributeError:
        return int(scalar)


class BackwardPass:
    """What one backward pass (an autograd graph task) recorded into: told to each when the pass ends.

    Each recipe state is told the region whose backward recorded into it first in the pass (delayed
    scaling's reduction carries its index, so a rank that ran a backward its peers did not, or in
    another order, fails the check)."""

    def __init__(self) -> None:
        self.groups: dict[RecipeState, Region] = {}  # state -> the first region that recorded into it
        self.regions: dict[Region, None] = {}

    def note(self, state: Optional[RecipeState], region: Optional[Region]) -> None:
        if region is None:  # its region was collected: it cannot be named, the state's latest stands in
            region = state.latest_region
        if state is not None:  # None: a recipe that keeps nothing
            self.groups.setdefault(state, region)
        self.regions[region] = None

    def end(self) -> None:
        for state, region in self.groups.items():
            state.backward_ended(region)
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


class ModuleHandles:
    """FP8 modules by handle: how the runtime's custom ops name them (never reset)."""

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
        handle._fp8train_int = self._count  # (`host_int`)
        return handle

    def module(self, handle: torch.Tensor) -> torch.nn.Module:
        return self._modules[host_int(handle)]


class CurrentPlans:
    """Each module's current forward call's `ForwardPlan` (not its GEMM calls, which are made from it):
    made at its first GEMM, for its later GEMMs, the custom ops of a compiled graph and readers
    (coverage, tensor statistics)."""

    def __init__(self) -> None:
        # id(module) -> its plan; an entry leaves when its module is collected (before the id can name
        # another object), so that a plain dict serves where a WeakKeyDictionary would make a weak
        # reference at every call (the lean path)
        self._plans: dict[int, Optional[ForwardPlan]] = {}

    def of(self, module: torch.nn.Module) -> Optional[ForwardPlan]:
        return self._plans.get(id(module))

    def begin(self, module: torch.nn.Module, plan: Optional[ForwardPlan]) -> None:
        key = id(module)
        if key not in self._plans:  # its first call: forgotten with it
            weakref.finalize(module, self._plans.pop, key, None)
        self._plans[key] = plan


class BackwardPasses:
    """The running backward pass's record, made (and its end queued) at its first FP8 backward node."""

    def __init__(self) -> None:
        self._current: Optional[tuple[int, BackwardPass]] = None  # (graph task, what it recorded)

    def current(self) -> BackwardPass:
        task = current_graph_task()
        if self._current is None or self._current[0] != task:
            record = BackwardPass()
            self._current = (task, record)
            at_end_of_backward(record.end)
        return self._current[1]


class Replay(Protocol):
    """A noted fp8train.checkpoint call (plans.CheckpointRecord), as the owners below see it."""

    stack: tuple[RegionSettings, ...]

    def add(self, module_id: int, plan: ForwardPlan) -> None: ...

    def next(self, module_id: int) -> Optional[ForwardPlan]: ...


class Recomputation:
    """fp8train.checkpoint calls: those whose forward runs (they note the plans of its FP8 calls) and
    the one being recomputed (its plans are replayed)."""

    def __init__(self) -> None:
        self.replaying: Optional[Replay] = None  # the call being recomputed
        self.noting: list[Replay] = []  # calls whose forward is running

    @contextlib.contextmanager
    def noting_into(self, record: Replay) -> Iterator[None]:
        self.noting.append(record)
        try:
            yield
        finally:
            self.noting.remove(record)

    @contextlib.contextmanager
    def replay(self, record: Replay, regions: RegionStack) -> Iterator[None]:
        """While `record` is recomputed: the regions active at the original call, and its noted plans."""
        saved, self.replaying = self.replaying, record
        try:
            with regions.replaced(record.stack):
                yield
        finally:
            self.replaying = saved


class Part(Protocol):
    """A part of the state that a recipe attaches (`State.attach`), reset with the rest."""

    def reset(self) -> None: ...


class State:
    def __init__(self) -> None:
        self.handles = ModuleHandles()
        self._parts: list[Part] = []
        self.reset()

    def attach(self, part: Part) -> Part:
        """Make `part` (a recipe's state, made once: amax/state.py) part of this state: reset with it."""
        self._parts.append(part)
        return part

    def reset(self) -> None:
        """Forget every region, call plan, backward pass and recomputation, and reset every attached
        part (delayed scaling: amax groups, channels, counters, the step boundary); keep the handles."""
        self.regions = RegionStack()
        self.calls = CurrentPlans()
        self.backward = BackwardPasses()
        self.recompute = Recomputation()
        for part in self._parts:
            part.reset()


STATE = State()

"""The one process-wide state of fp8train, and its only owner (docs/design.md, section 3).

Everything the protocol must find again between calls lives here: the stack of active
`fp8_autocast` settings and the outermost region being run, the live regions (backward nodes and
recomputations name them by serial), the amax groups and the channel of each process group, the
reduction counters, the FP8 modules by handle (how compiled graphs name them) with each one's plan
for its current call, the running backward pass, and the activation-recomputation calls being noted
or replayed. Other modules read it and change it through its methods only; `reset()` (tests,
benchmarks: `fp8train.inspection.reset`) forgets it all but the module handles.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from ..torch_internals import at_end_of_backward, graph_task_id
from .channel import Channel
from .membership import reduces_across_ranks, world_if_default
from .reduction import AmaxGroup
from .stats import ReductionStats

if TYPE_CHECKING:
    from .calls import Plan
    from .regions import BackwardPass, Region, RegionSettings

__all__ = ["Registry", "REGISTRY", "KEPT_REGIONS"]

KEPT_REGIONS = 64  # the most recent regions stay alive for the backward nodes that name them


class Registry:
    def __init__(self) -> None:
        # never reset: a module keeps its handle, which compiled graphs hold, across resets
        self._handles = 0
        self.modules: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
        self.reset()

    def reset(self) -> None:
        """Forget every region, amax group, channel, call plan and counter."""
        self.stack: list[RegionSettings] = []  # active fp8_autocast settings, innermost last
        self.region: Optional[Region] = None  # the outermost region being run
        self.regions: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()
        self.recent: collections.deque[Region] = collections.deque(maxlen=KEPT_REGIONS)
        self.regions_entered = 0
        self.groups: dict[tuple, AmaxGroup] = {}
        self.channels: dict[object, Channel] = {}
        self.stats = ReductionStats()
        self.plans: weakref.WeakKeyDictionary[torch.nn.Module, Plan] = weakref.WeakKeyDictionary()
        self._backward_pass: Optional[tuple[int, BackwardPass]] = None  # (graph task, what it recorded)
        self.step_groups: dict[AmaxGroup, None] = {}  # per-step groups this rank trained, in that order
        self.boundaries = 0  # step boundaries taken (steps.py)
        self.step_parameters: dict[int, tuple] = {}  # module id -> its parameters' versions this step
        self.recompute = None  # the fp8train.checkpoint call being recomputed (recompute.CallRecord)
        self.checkpoints: list = []  # fp8train.checkpoint calls whose forward is running: they note plans

    # ---- regions ------------------------------------------------------------------------------------
    @property
    def settings(self) -> Optional[RegionSettings]:
        """The innermost active region's settings (None outside every region)."""
        return self.stack[-1] if self.stack else None

    def push(self, settings: RegionSettings, region: Optional[Region]) -> None:
        self.stack.append(settings)
        if region is not None:
            self.regions_entered = region.serial
            self.region = region
            self.regions[region.serial] = region
            self.recent.append(region)

    def pop(self, region: Optional[Region]) -> None:
        self.stack.pop()
        if region is not None:
            self.region = None

    def live_regions(self) -> list[Region]:
        return list(self.regions.values())

    def region_by_serial(self, serial: int) -> Optional[Region]:
        return self.regions.get(serial)

    # ---- amax groups ---------------------------------------------------------------------------------
    def amax_group(self, recipe, process_group) -> AmaxGroup:
        """The amax group of `recipe` (a DelayedScaling) on `process_group` (None: the world)."""
        process_group = world_if_default(process_group)
        # recipes equal as the header sees them (callables by their code) share a group
        key = (recipe.key(), recipe.reduce_amax, process_group)
        group = self.groups.get(key)
        if group is None:
            channel = None
            if reduces_across_ranks(recipe, process_group):
                channel = self.channels.setdefault(process_group, Channel(process_group))
            group = self.groups[key] = AmaxGroup(recipe, process_group, channel, self.stats)
        return group

    def note_step_group(self, group: AmaxGroup) -> None:
        """A per-step group that trained: launched at every step boundary from now on, in the order in
        which the groups first trained (the same on every rank)."""
        self.step_groups.setdefault(group, None)

    # ---- modules and their calls ---------------------------------------------------------------------
    def register_module(self, module: torch.nn.Module) -> torch.Tensor:
        """A new handle for `module`: how the protocol's ops (ops.py) name it, in eager code and in
        compiled graphs. A host int64 scalar rather than an int: a graph takes a tensor attribute as an
        input, so one graph serves every module of a kind, where dynamo would guard an int attribute's
        value and compile once per module (a model's blocks compiled one by one)."""
        self._handles += 1
        self.modules[self._handles] = module
        handle = torch.tensor(self._handles, dtype=torch.int64, device="cpu")
        handle._fp8train_host_mirror = True  # host memory by design: reading it never waits for a device
        return handle

    def module(self, handle: torch.Tensor) -> torch.nn.Module:
        return self.modules[int(handle)]

    def plan_of(self, module: torch.nn.Module) -> Optional[Plan]:
        """The plan of `module`'s current call (made at its first GEMM)."""
        return self.plans.get(module)

    def set_plan(self, module: torch.nn.Module, plan: Optional[Plan]) -> None:
        self.plans[module] = plan

    # ---- backward passes ------------------------------------------------------------------------------
    def backward_pass(self, make) -> BackwardPass:
        """The running backward pass's record, made with `make()` (and its end queued) at its first
        FP8 backward node."""
        task = graph_task_id()
        if self._backward_pass is None or self._backward_pass[0] != task:
            record = make()
            self._backward_pass = (task, record)
            at_end_of_backward(record.end)
        return self._backward_pass[1]

    # ---- activation recomputation (recompute.py) ------------------------------------------------------
    @contextlib.contextmanager
    def noting(self, call) -> Iterator[None]:
        """While `call`'s forward runs, FP8 calls note their plans in it."""
        self.checkpoints.append(call)
        try:
            yield
        finally:
            self.checkpoints.remove(call)

    @contextlib.contextmanager
    def replaying(self, call, stack: list) -> Iterator[None]:
        """While `call` is recomputed: the regions active at the original call, and its noted plans."""
        saved = self.recompute, self.stack
        self.recompute, self.stack = call, list(stack)
        try:
            yield
        finally:
            self.recompute, self.stack = saved

    def synchronize(self) -> None:
        """Complete every in-flight amax reduction and apply it, then raise any mismatch. No collective."""
        for group in self.groups.values():
            group.fwd.finish()
            group.bwd.finish()
        for channel in self.channels.values():
            channel.check(block=True)


REGISTRY = Registry()

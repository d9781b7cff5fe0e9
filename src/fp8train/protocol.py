"""When every amax group launches and finishes: regions, the plan of each FP8 call, backward bookkeeping.

docs/design.md, section 3. The rules, all applied in this file:

- An amax group's forward amaxes are launched when the outermost `fp8_autocast` exits, for a region
  in which the group recorded amaxes for training (an FP8 call with grad enabled, or a calibrating
  one), in the order in which the groups first trained in it. A region in which a group trained
  nothing (evaluation without grad, no call at all) launches nothing for it and does not count, so
  one rank may evaluate, or evaluate more batches, alone.
- Each amax group numbers its own training regions; the number travels in every header.
- Backward amaxes are launched when the backward pass that recorded them ends (`queue_callback`):
  the same point on every rank, whatever else issued collectives during the pass.
- `Direction.finish` (reduction.py) is the only wait, and every call of it is in this file (and in
  `Direction.launch`, which completes the previous reduction first): the
  first FP8 call of a region (forward scales), the first FP8 backward node of a pass (backward
  scales), a launch, and every reader of FP8 state (`settle`: fp8_meta, state_dict, telemetry;
  `synchronize`).
"""

from __future__ import annotations

import collections
import os
import sys
import weakref
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .recipe import DelayedScaling, Recipe, recipe_kind
from .reduction import AmaxGroup, Channel, Direction, ReductionStats, recipe_key
from .tensor_parallel import check_amax_group

__all__ = [
    "ENV_ASYNC",
    "REGISTRY",
    "Plan",
    "Region",
    "RegionSettings",
    "async_amax_reduction",
    "enter_region",
    "exit_region",
    "plan_forward",
    "settle",
    "synchronize",
    "reduction_stats",
    "reset_reduction_stats",
]

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"


def async_amax_reduction() -> bool:
    """Read NVTE_ASYNC_AMAX_REDUCTION: unset or '1' is asynchronous, '0' blocking."""
    value = os.environ.get(ENV_ASYNC)
    if value is None or value.strip() == "1":
        return True
    if value.strip() == "0":
        return False
    raise ValueError(f"{ENV_ASYNC}={value!r} is not valid: use 1 (asynchronous, the default) or 0 (blocking)")


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (where a forward is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class RegionSettings:
    enabled: bool
    calibrating: bool
    recipe: Recipe
    group: object  # torch.distributed ProcessGroup or None for the world


@dataclass
class Plan:
    """How one forward call of an FP8 module runs, and what its backward owes the protocol."""

    fp8: bool
    scale: torch.Tensor  # forward scales of the module's group (a frozen snapshot), indexed by column
    scale_inv: torch.Tensor
    fwd_offset: int
    bwd_offset: int
    records_into: Optional[Direction] = None  # forward amaxes go here (None: record nothing)
    region: Optional[Region] = None  # an FP8 training call: the region whose backward it owes
    serial: int = -1  # that region's serial, also in a replay (which holds no reference to it)
    bwd_encoding: str = "e5m2"  # the FP8 encoding of its gradients
    recipe: Optional[Recipe] = None  # a recipe that scales from the tensors themselves (no protocol)


class Region:
    """One outermost fp8_autocast entry: the amax groups it trained, and its forward calls."""

    def __init__(self, serial: int, async_op: bool) -> None:
        self.serial = serial
        self.async_op = async_op
        self.grad_at_entry = torch.is_grad_enabled()
        self.trained: dict[AmaxGroup, int] = {}  # groups in the order they first trained -> index
        self.snapshots: dict[Direction, tuple[torch.Tensor, torch.Tensor]] = {}  # frozen (scale, scale_inv)
        self.calls: dict[int, collections.deque] = {}  # module id -> forward plans, for recomputation
        self.outputs: list[weakref.ref] = []  # autograd nodes of its FP8 training calls' outputs
        self.compiled_calls = False  # training calls from a compiled graph, whose outputs are not seen
        self.backward_done = False

    def owes_backward(self) -> bool:
        """Its backward has not run and its graph is alive (a dropped graph owes nothing)."""
        if self.backward_done:
            return False
        # no node: no call produced a graph (frozen layers), unless a compiled graph made the calls
        return self.compiled_calls or any(node() is not None for node in self.outputs)

    def index_of(self, group: AmaxGroup) -> int:
        """This region's index among `group`'s training regions (taken by its first launch)."""
        if self.trained[group] < 0:
            self.trained[group] = group.next_region_index()
        return self.trained[group]

    def forward_scales(self, direction: Direction) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, scale_inv) this region uses for `direction`: finished once, then frozen (a copy)."""
        snap = self.snapshots.get(direction)
        if snap is None or snap[0].numel() != direction.storage.num_roles:
            direction.finish()
            direction.check()
            snap = (direction.storage.scale.clone(), direction.storage.scale_inv.clone())
            self.snapshots[direction] = snap
        return snap


class BackwardPass:
    """What one backward pass (an autograd graph task) recorded: launched when the pass ends.

    Each group's reduction carries the index of the region whose backward recorded into it first in
    the pass, so a rank that ran a backward its peers did not (or in another order) fails the check.
    """

    def __init__(self) -> None:
        self.groups: dict[AmaxGroup, Region] = {}  # group -> the first region that recorded into it
        self.regions: dict[Region, None] = {}

    def note(self, group: Optional[AmaxGroup], region: Optional[Region]) -> None:
        if region is None:  # its region was collected: it cannot be named, the group's latest stands in
            region = group.latest_region
        if group is not None:  # None: a current or block scaling call, which reduces nothing
            self.groups.setdefault(group, region)
        self.regions[region] = None

    def end(self) -> None:
        for group, region in self.groups.items():
            if group.bwd.recorded_columns:
                group.bwd.launch(region.async_op, region.index_of(group))
        for region in self.regions:
            region.backward_done = True
            region.calls.clear()


def _world_if_default(process_group):
    if process_group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return process_group


def _reduces(recipe: DelayedScaling, process_group) -> bool:
    if not (recipe.reduce_amax and dist.is_available() and dist.is_initialized()):
        return False
    # A group this rank is not in reports world size -1, which would read as "no reduction" and let
    # the rank train alone, silently, with its own scales.
    if dist.get_rank(process_group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the amax reduction group passed to "
            "fp8_autocast(fp8_group=...); pass a group that contains every rank that runs this region"
        )
    return dist.get_world_size(process_group) > 1


class Registry:
    """The one process-wide state: the stack of active regions, and the amax groups and channels."""

    def __init__(self) -> None:
        self.stack: list[RegionSettings] = []
        self.region: Optional[Region] = None  # the outermost region being run
        self.groups: dict[tuple, AmaxGroup] = {}
        self.channels: dict[object, Channel] = {}
        self.stats = ReductionStats()
        # live regions by serial: backward nodes name their region by serial (a CPU tensor that can
        # pass through compiled graphs), and torch checkpointing matches recomputations to them
        self.regions: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()
        self.recent_regions: collections.deque[Region] = collections.deque(maxlen=64)  # kept alive
        self.modules: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
        self.modules_registered = 0
        self.backward_pass: Optional[tuple[int, BackwardPass]] = None  # (graph task, what it recorded)
        self.regions_entered = 0
        self.recompute = None  # the fp8train.checkpoint call being recomputed (recompute.CallRecord)
        self.checkpoints: list = []  # fp8train.checkpoint calls whose forward is running: they note plans

    def amax_group(self, recipe: DelayedScaling, process_group) -> AmaxGroup:
        process_group = _world_if_default(process_group)
        # recipes equal as the header sees them (callables by their code) share a group
        key = (recipe_key(recipe), recipe.reduce_amax, process_group)
        group = self.groups.get(key)
        if group is None:
            channel = None
            if _reduces(recipe, process_group):
                channel = self.channels.setdefault(process_group, Channel(process_group))
            group = self.groups[key] = AmaxGroup(recipe, process_group, channel, self.stats)
        return group


REGISTRY = Registry()


# ---- regions ----------------------------------------------------------------------------------------
def enter_region(settings: RegionSettings) -> Optional[Region]:
    """Push `settings`; return the new Region when this entry is outermost (None otherwise)."""
    replaying = REGISTRY.recompute is not None or in_backward()
    region = None
    if not REGISTRY.stack and not replaying:
        region = Region(REGISTRY.regions_entered + 1, async_amax_reduction())
    delayed = isinstance(settings.recipe, DelayedScaling)  # the other recipes have no amax group
    if (settings.enabled or settings.calibrating) and delayed and not replaying:
        REGISTRY.amax_group(settings.recipe, settings.group)  # a group this rank is not in: raise now
    # nothing above may have left state behind: it can raise (a bad env value, a foreign group)
    REGISTRY.stack.append(settings)
    if region is not None:
        REGISTRY.regions_entered += 1
        REGISTRY.region = region
        REGISTRY.regions[region.serial] = region
        REGISTRY.recent_regions.append(region)
    return region


def exit_region(region: Optional[Region], failed: bool) -> None:
    """Pop a region; when it is the outermost, launch the forward reductions it owes.

    A region that raised launches what it owes with its amaxes discarded, so a rank that caught an
    exception its peers did not have fails their header check instead of pairing other steps.
    """
    REGISTRY.stack.pop()
    if region is None:
        return
    REGISTRY.region = None
    for group in region.trained:
        if failed:
            group.fwd.discard_recording()
        group.latest_region = region
        group.fwd.launch(region.async_op, region.index_of(group))


# ---- the plan of one FP8 call -------------------------------------------------------------------------
def plan_forward(module, training: bool) -> Optional[Plan]:
    """How `module` (an FP8Module) runs this forward call: precision, scales, where amaxes go.

    `training`: grad is enabled for the call (given, not read: a compiled graph runs without grad)."""
    if REGISTRY.recompute is not None or in_backward():
        plan = _recompute_plan(module)
        if plan is not None:
            for call in REGISTRY.checkpoints:  # a checkpoint nested in the one being recomputed
                call.add(id(module), plan)
        return plan
    settings = REGISTRY.stack[-1] if REGISTRY.stack else None
    if settings is None or not (settings.enabled or settings.calibrating):
        return None
    region = REGISTRY.region
    if settings.enabled and training:
        check_recipe_kind(module, recipe_kind(settings.recipe))
    if settings.enabled and not training and region.grad_at_entry:
        _refuse_reentrant_checkpoint()
    trains = settings.enabled and training
    if isinstance(settings.recipe, DelayedScaling):
        plan = _delayed_plan(module, settings, region, training)
    elif settings.enabled:  # current or block scaling: scales from the tensors, no protocol
        recipe = settings.recipe
        plan = Plan(True, None, None, 0, 0, bwd_encoding=recipe.fp8_format.bwd, recipe=recipe)
    else:
        return None  # calibrating records amaxes for delayed scaling only
    plan.region, plan.serial = (region, region.serial) if trains else (None, -1)
    if training:  # noted for recomputation; the replay holds no region reference and records nothing
        region.backward_done = False  # (again, when a backward ran inside the region)
        replay = replace(plan, records_into=None, region=None)
        region.calls.setdefault(id(module), collections.deque()).append(replay)
        for call in REGISTRY.checkpoints:
            call.add(id(module), replay)
    return plan


def _delayed_plan(module, settings: RegionSettings, region: Region, training: bool) -> Plan:
    """Delayed scaling: the module joins its amax group when it first records; the region's frozen
    scales; amaxes recorded when training or calibrating."""
    group = REGISTRY.amax_group(settings.recipe, settings.group)
    record = settings.calibrating or training
    fwd_meta, bwd_meta = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
    if record:
        if group not in region.trained:
            if group.fwd.channel is not None:
                _refuse_ddp_join()
        if fwd_meta.direction is None:
            check_amax_group(module, group.process_group, group.fwd.channel is not None)
            device = next(module.parameters()).device
            fwd_meta.join(group.fwd, module._signature(), device)
            bwd_meta.join(group.bwd, module._signature(), device)
        elif fwd_meta.direction is not group.fwd:
            raise RuntimeError(
                f"{module._signature()} trains under one recipe and amax group; it was first trained "
                f"with {fwd_meta.direction.recipe} and is now run with {settings.recipe} (or another "
                "group). Use the same fp8_recipe and fp8_group for every training region of a module"
            )
        region.trained.setdefault(group, -1)  # only once the module is a member: it can launch
    if fwd_meta.direction is None:  # not trained yet (evaluation): its own scales, on its device
        device = next(module.parameters()).device
        (scale, scale_inv), offset = fwd_meta.own_scales(device), 0
    else:
        scale, scale_inv = region.forward_scales(fwd_meta.direction)
        offset = fwd_meta.offset
    return Plan(
        fp8=settings.enabled,
        scale=scale,
        scale_inv=scale_inv,
        fwd_offset=offset,
        bwd_offset=bwd_meta.offset,
        records_into=group.fwd if record else None,
        bwd_encoding=settings.recipe.fp8_format.bwd,
    )


def check_recipe_kind(module, kind: str) -> None:
    """A module trains under one kind of recipe: its FP8 state (and a checkpoint of it) belongs to it."""
    if module._fp8_recipe_kind is None:
        module._fp8_recipe_kind = kind
    elif module._fp8_recipe_kind != kind:
        raise RuntimeError(
            f"{module._signature()} was trained with {module._fp8_recipe_kind} scaling (by this run, or "
            f"in the checkpoint it was loaded from) and is now trained with {kind} scaling. Keep the "
            "recipe of the run (or of the checkpoint), or start from a model that has not trained"
        )


def _recompute_plan(module) -> Optional[Plan]:
    """The plan of the original forward call, replayed: same scales, no amax, no registration."""
    call = REGISTRY.recompute
    if call is not None:  # fp8train.checkpoint noted this call's plans and restored its settings
        settings = REGISTRY.stack[-1] if REGISTRY.stack else None
        if settings is None or not (settings.enabled or settings.calibrating):
            return None  # the original call ran in high precision
        plan = call.next(id(module))
        if plan is None:
            raise RuntimeError(
                f"{module._signature()} runs more often in the recomputed forward than in the original "
                "one; a function passed to fp8train.checkpoint must call the same FP8 modules each time"
            )
        return plan
    # torch.utils.checkpoint(use_reentrant=False): the one region whose backward still owes a call
    candidates = [r for r in list(REGISTRY.regions.values()) if r.owes_backward() and r.calls.get(id(module))]
    if not candidates:
        return None  # no FP8 training call pending: the original forward was high precision
    first = candidates[0].calls[id(module)][0]
    stateless = first.recipe is not None and all(
        p.recipe == first.recipe for r in candidates for p in r.calls[id(module)]
    )  # current or block scaling: any pending call of the same recipe replays alike
    plans = candidates[0].calls[id(module)] if len(candidates) == 1 or stateless else ()
    # backward recomputes later calls first: taking the oldest plan is right only if all are alike
    if plans and all(p.fp8 == plans[0].fp8 and p.scale is plans[0].scale for p in plans):
        return plans.popleft()
    raise RuntimeError(
        f"{module._signature()} is being recomputed during backward, but fp8train cannot tell which "
        f"FP8 forward it repeats ({len(candidates)} candidate regions, or calls of it that ran "
        "differently in one region). Wrap the recomputed code in "
        "fp8train.checkpoint(fn, *args), or use torch.utils.checkpoint with use_reentrant=False "
        "and one region per backward pass; a region's backward must run in one backward pass"
    )


def _refuse_reentrant_checkpoint() -> None:
    """Raise inside torch.utils.checkpoint(use_reentrant=True) in a training region.

    Its forward runs without grad, so the FP8 call records nothing and owes no backward, and its
    recomputation in backward cannot be told apart from another call of the same module. Called for
    FP8 calls without grad in a region entered with grad (evaluation inside a training region, or
    this), so evaluation under no_grad outside the region pays nothing.
    """
    reentrant_forward = torch.utils.checkpoint.CheckpointFunction.forward.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is reentrant_forward:
            raise RuntimeError(
                "torch.utils.checkpoint(..., use_reentrant=True) over FP8 modules in a training region: "
                "use_reentrant=True is not supported (its forward runs without autograd, so its FP8 "
                "calls cannot be matched to their recomputation). Use fp8train.checkpoint(fn, *args) or "
                "torch.utils.checkpoint(fn, *args, use_reentrant=False)"
            )
        frame = frame.f_back


def _refuse_ddp_join() -> None:
    """Raise inside DistributedDataParallel's join() (uneven inputs) unless it throws on early termination.

    A rank that ran out of data shadows DDP's collectives, not the amax all-reduces, so the others'
    amax collectives would pair with DDP's (gloo kills the process on the size mismatch; NCCL hangs).
    Called at the first FP8 call of each region: every rank raises in its first step inside join(),
    before any rank can have joined. Reads DDP's private `_join_config` (torch >= 2.0).
    """
    ddp_forward = torch.nn.parallel.DistributedDataParallel.forward.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is ddp_forward:
            config = getattr(frame.f_locals.get("self"), "_join_config", None)
            if config is not None and config.enable and not config.throw_on_early_termination:
                raise RuntimeError(
                    "DistributedDataParallel.join() (uneven inputs) cannot be used with a multi-rank FP8 "
                    "amax reduction: a rank that ran out of data would shadow DDP's collectives but not "
                    "fp8train's amax all-reduce, and the other ranks would hang or abort. Use "
                    "join(throw_on_early_termination=True) (every rank stops when one runs out of data), "
                    "give every rank the same number of batches (e.g. DistributedSampler(drop_last=True)), "
                    "or DelayedScaling(reduce_amax=False)"
                )
            return
        frame = frame.f_back


# ---- what an FP8 GEMM call asks of the protocol (eager, and at run time under torch.compile) ---------
FWD_ROLES = 3  # input, weight, output per GEMM
BWD_ROLES = 2  # grad_output, grad_input per GEMM
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 0


def register_module(module: torch.nn.Module) -> int:
    """A handle for `module`: how compiled graphs name it to the protocol's ops."""
    REGISTRY.modules_registered += 1
    REGISTRY.modules[REGISTRY.modules_registered] = module
    return REGISTRY.modules_registered


class CallPrecision(NamedTuple):
    fp8: bool  # the GEMM runs in FP8
    record: bool  # its amaxes are recorded (training, or calibrating)
    bwd_encoding: str = "e5m2"  # the FP8 encoding of its gradients
    recipe: Optional[Recipe] = None  # current or block scaling: scales from the tensors, no protocol


def call_precision(module, gemm_index: int) -> CallPrecision:
    """How GEMM `gemm_index` of `module`'s current forward call runs.

    Eager, the call's plan is made here (at its first GEMM). Under torch.compile the answer comes from
    the region settings and grad mode, which dynamo guards, and the plan is made at run time by the
    forward_scales op: the same rules, since a compiled graph is never a recomputation.
    """
    if torch.compiler.is_compiling():
        settings = REGISTRY.stack[-1] if REGISTRY.stack else None
        if settings is None or not (settings.enabled or settings.calibrating):
            return CallPrecision(False, False)
        if not isinstance(settings.recipe, DelayedScaling):  # its kind is checked by the caller's op
            return CallPrecision(settings.enabled, False, settings.recipe.fp8_format.bwd, settings.recipe)
        record = settings.calibrating or torch.is_grad_enabled()
        return CallPrecision(settings.enabled, record, settings.recipe.fp8_format.bwd)
    REGISTRY.modules[module._fp8_handle] = module  # (again: the registry may have been reset)
    if gemm_index == 0:
        module._fp8_plan = plan_forward(module, torch.is_grad_enabled())
    plan = module._fp8_plan
    if plan is None:
        return CallPrecision(False, False)
    return CallPrecision(plan.fp8, plan.records_into is not None, plan.bwd_encoding, plan.recipe)


def forward_scales(
    module,
    gemm_index: int,
    x_amax: Optional[torch.Tensor],
    w_amax: Optional[torch.Tensor],
    training: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Record this GEMM's amaxes; return its scales [[x, w], [x_inv, w_inv]] and its region's token.

    The scales are the region's frozen ones (a copy); the token (a CPU int64 scalar) names the
    region to the backward of a training call, -1 otherwise. With `training` given (the op under
    torch.compile), the call's plan is made here; otherwise `call_precision` made it."""
    if training is not None and gemm_index == 0:
        module._fp8_plan = plan_forward(module, training)
        if module._fp8_plan is not None and module._fp8_plan.region is not None:
            module._fp8_plan.region.compiled_calls = True
    plan = module._fp8_plan
    base = plan.fwd_offset + FWD_ROLES * gemm_index
    if plan.records_into is not None:
        if x_amax is not None:
            plan.records_into.record(base + INPUT, x_amax)
        if w_amax is not None:
            plan.records_into.record(base + WEIGHT, w_amax)
    scales = torch.stack([plan.scale[base : base + 2], plan.scale_inv[base : base + 2]])
    token = torch.tensor(plan.serial)
    token._fp8train_host_mirror = True  # host memory by design: reading it never waits for a device
    return scales, token


def backward_scales(module, gemm_index: int, g_amax: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Record this backward GEMM's grad_output amax; return [scale, scale_inv] for it.

    Waits for earlier steps' backward reductions first (wait before read), and makes sure the pass
    launches the group's backward reduction when it ends."""
    meta = module.fp8_meta["scaling_bwd"]
    direction = meta.direction
    direction.finish()
    direction.check()
    column = meta.offset + BWD_ROLES * gemm_index + GRAD_OUTPUT
    direction.record(column, g_amax)
    _backward_pass().note(direction.group, REGISTRY.regions.get(int(token)))
    return torch.stack([direction.storage.scale[column], direction.storage.scale_inv[column]])


def _backward_pass() -> BackwardPass:
    """The running backward pass's record, made (and its end queued) at the first FP8 backward."""
    task = torch._C._current_graph_task_id()
    if REGISTRY.backward_pass is None or REGISTRY.backward_pass[0] != task:
        backward_pass = BackwardPass()
        REGISTRY.backward_pass = (task, backward_pass)
        torch.autograd.Variable._execution_engine.queue_callback(backward_pass.end)
    return REGISTRY.backward_pass[1]


def note_training_output(module, output: torch.Tensor) -> None:
    """An FP8 training call's output: its region owes a backward while this graph lives. Current and
    block scaling record nothing in backward, so a hook on the node marks their region's backward as
    run (for plain torch.utils.checkpoint's recomputations to find the regions still pending)."""
    if torch.compiler.is_compiling():
        return
    plan = module._fp8_plan
    if plan is None or plan.region is None or output.grad_fn is None:
        return
    region = plan.region
    region.outputs.append(weakref.ref(output.grad_fn))
    if plan.recipe is not None:
        output.grad_fn.register_hook(lambda *_: _backward_pass().note(None, region))


@dataclass(frozen=True)
class WeightGather:
    """How FSDP2 gathers a module's weight for a forward (fsdp.py)."""

    scales: Optional[tuple[torch.Tensor, torch.Tensor]]  # (scale, scale_inv) in FP8; None: parameter dtype
    region: Optional[Region]  # the FP8 region it was gathered for


class GatherBook:
    """A weight's latest gather, and the training forwards that saved its FP8 values for backward
    (their autograd nodes, weakly: a dropped graph owes nothing) until their backward runs."""

    def __init__(self) -> None:
        self.latest = WeightGather(None, None)
        self.owed: list[tuple[weakref.ref, WeightGather]] = []

    def pending(self) -> list[WeightGather]:
        self.owed = [(node, gather) for node, gather in self.owed if node() is not None]
        return [gather for _, gather in self.owed]


def _gather_book(module, gemm_index: int) -> GatherBook:
    return module.__dict__.setdefault("_fsdp_gathers", {}).setdefault(gemm_index, GatherBook())


def weight_gather(module, gemm_index: int, shard_ranks: list[int]) -> WeightGather:
    """How FSDP2 gathers `module`'s weight of GEMM `gemm_index` now: in FP8 with the weight role's
    scale of the current region (the one its forward will cast with), or in the parameter dtype
    outside an FP8 region of delayed scaling. A backward re-gather reproduces the gather whose FP8
    values a forward saved, and records nothing."""
    book = _gather_book(module, gemm_index)
    pending = book.pending()
    if in_backward():
        return pending[-1] if pending else book.latest
    settings = REGISTRY.stack[-1] if REGISTRY.stack else None
    delayed = settings is not None and settings.enabled and isinstance(settings.recipe, DelayedScaling)
    region = REGISTRY.region if delayed else None  # other recipes cast the whole weight: gathered as is
    if any(gather.region is not region for gather in pending):
        raise RuntimeError(
            f"{module._signature()} (fsdp_fp8_all_gather) ran forward in another FP8 region or precision "
            "before the backward of its previous training forward: FSDP2's backward re-gather could not "
            "reproduce the FP8 weight that forward used. Run that backward first (schedules with several "
            "microbatches in flight are not supported with the option), or build the module without it"
        )
    scales = None
    if region is not None:
        if not hasattr(module, "fp8_meta"):  # FSDP2 gathers a tied weight for the module that holds it
            raise RuntimeError(
                f"fsdp_fp8_all_gather: FSDP2 gathers a weight for {type(module).__name__}, which shares it "
                "with an FP8 module (tied weights, e.g. an embedding and the output head). A weight gathered "
                "in FP8 is for its FP8 module only. Build that FP8 module without fsdp_fp8_all_gather (e.g. "
                "leave the head out of convert_to_fp8 with its filter), or untie the weights"
            )
        group = REGISTRY.amax_group(settings.recipe, settings.group)
        amax_ranks = dist.get_process_group_ranks(group.process_group) if group.fwd.channel else []
        if len(set(shard_ranks)) > 1 and not set(shard_ranks) <= set(amax_ranks):  # one shard: its own
            raise ValueError(
                f"{module._signature()} (fsdp_fp8_all_gather): FSDP2 shards its weight over ranks "
                f"{shard_ranks} but the amax group reduces over {amax_ranks or 'no ranks'}: each shard would "
                "be cast with its own scale. Use an fp8_group that contains the sharding group (the default, "
                "all ranks, does) with reduce_amax=True, or build the module without fsdp_fp8_all_gather"
            )
        meta = module.fp8_meta["scaling_fwd"]
        column = meta.offset + FWD_ROLES * gemm_index + WEIGHT
        if meta.direction is None:  # not trained yet: its own scale, which joining will keep
            scale, scale_inv = meta.own_scales(next(module.parameters()).device)
        else:
            scale, scale_inv = region.forward_scales(meta.direction)
        scales = (scale[column], scale_inv[column])
    book.latest = WeightGather(scales, region)
    return book.latest


def is_current_gather(gather: WeightGather) -> bool:
    """Whether a weight gathered in FP8 for `gather` may serve this call: gathered for this region,
    or a recomputation in backward (whose re-gather reproduced the original forward's)."""
    return gather.region is REGISTRY.region or in_backward() or REGISTRY.recompute is not None


def note_gathered_forward(module, gemm_index: int, gather: WeightGather, output: torch.Tensor) -> None:
    """A training forward saved the FP8 weight gathered for `gather`: its backward re-gather must match."""
    if output.grad_fn is not None:
        _gather_book(module, gemm_index).owed.append((weakref.ref(output.grad_fn), gather))


def gathered_backward_ran(handle: int, gemm_index: int, node) -> None:
    """The backward of the forward whose autograd node is `node` ran: it owes nothing any more."""
    book = REGISTRY.modules[handle].__dict__.get("_fsdp_gathers", {}).get(gemm_index)
    if book is not None:
        book.owed = [(ref, gather) for ref, gather in book.owed if ref() is not node]


# ---- readers of FP8 state ----------------------------------------------------------------------------
def settle(direction: Direction, host_point: bool = False) -> None:
    """Complete `direction`'s reductions before its state is read; issues no collective.

    Only at a host point (a checkpoint) is a mismatch raised: seen on the device, even if its flag has
    not reached the host yet (this waits for the device). Other readers can inspect the state after one."""
    direction.finish()
    if host_point:
        direction.check(block=True)


def synchronize() -> None:
    """Complete every in-flight amax reduction and apply it, then raise any mismatch. No collective."""
    for group in REGISTRY.groups.values():
        group.fwd.finish()
        group.bwd.finish()
    for channel in REGISTRY.channels.values():
        channel.check(block=True)


def reduction_stats(complete: bool = True) -> dict:
    """Per-process reduction counters: launched, bytes_reduced, exposed_wait_s, hidden_s, updates,
    nonfinite_amax_events.

    By default in-flight reductions are completed first (no collective is issued), so the counters
    include the last step's update; `complete=False` reads them without waiting.
    """
    if complete:
        synchronize()
    return REGISTRY.stats.as_dict()


def reset_reduction_stats() -> None:
    REGISTRY.stats.__init__()

"""The plan of each FP8 module call: its precision, what its recipe keeps for it (delayed scaling:
the frozen scales and where its amaxes go, amax/state.py) and what its backward owes its region
(docs/design.md, sections 3, 3.1 and 5).

A module call's plan is made at its first GEMM (calls.py) by its recipe (`RecipeRuntime.plan_call`)
and is the module's current call for the rest of the call (`STATE.calls`). Training calls note their
plan in their region, so that an activation recomputation in backward replays it: same scales, no
amax recorded; fp8train.checkpoint notes the plans of its function's calls and replays them in order
(`recomputation_context_fn`).
"""

from __future__ import annotations

from typing import Callable, Optional

from ..torch_internals import current_graph_task, inside_reentrant_checkpoint
from .state import STATE, ForwardPlan, RegionSettings, RuntimeModule

__all__ = ["plan_forward", "CheckpointRecord", "recomputation_context_fn"]


def plan_forward(module: RuntimeModule, training: bool, compiled: bool = False) -> Optional[ForwardPlan]:
    """How `module` (an FP8Module) runs this forward call; None: in high precision, recording nothing.

    `training`: grad is enabled for the call (given, not read: a compiled graph runs without grad);
    `compiled`: the call is made by a compiled graph (whose outputs the region does not see)."""
    if STATE.recompute.replaying is not None or current_graph_task() != -1:  # (in_backward, inline)
        plan = _recompute_plan(module)
        if plan is not None:
            for record in STATE.recompute.noting:  # a checkpoint nested in the one being recomputed
                record.add(id(module), plan)
        return plan
    stack = STATE.regions.stack  # (the settings and `active` properties, inline: every call asks)
    settings = stack[-1] if stack else None
    if settings is None or not (settings.enabled or settings.calibrating):
        return None
    region = STATE.regions.region
    quantization = settings.quantization
    if settings.enabled and training and module.recipe_kind != quantization.kind:
        module.claim_recipe_kind(quantization.kind)
    if settings.enabled and not training and region.grad_at_entry:
        _refuse_reentrant_checkpoint()
    plan = quantization.plan_call(module, settings, region, training)
    if plan is None:
        return None  # e.g. calibrating, which records amaxes for recipes with state only
    if settings.enabled and training:
        plan.region, plan.serial = region, region.serial
    if training:  # noted for recomputation; the replay holds no region reference and records nothing
        replay = plan.replay()
        region.note_training_call(id(module), replay, compiled and plan.region is not None)
        for record in STATE.recompute.noting:
            record.add(id(module), replay)
    return plan


def _recompute_plan(module: RuntimeModule) -> Optional[ForwardPlan]:
    """The plan of the original forward call, replayed: same scales, no amax, no registration."""
    record = STATE.recompute.replaying
    if record is not None:  # fp8train.checkpoint noted this call's plans and restored its settings
        settings = STATE.regions.settings
        if settings is None or not settings.active:
            return None  # the original call ran in high precision
        plan = record.next(id(module))
        if plan is None:
            raise RuntimeError(
                f"{module.signature} runs more often in the recomputed forward than in the original "
                "one; a function passed to fp8train.checkpoint must call the same FP8 modules each time"
            )
        return plan
    # torch.utils.checkpoint(use_reentrant=False): the one region whose backward still owes a call
    candidates = [r for r in STATE.regions.live() if r.owes_backward() and r.calls.get(id(module))]
    if not candidates:
        return None  # no FP8 training call pending: the original forward was high precision
    first = candidates[0].calls[id(module)][0]
    alike = all(
        first.quantization.replays_alike(p.quantization) for r in candidates for p in r.calls[id(module)]
    )  # a recipe that scales each tensor from itself: any pending call of it replays alike
    plans = candidates[0].calls[id(module)] if len(candidates) == 1 or alike else ()
    # backward recomputes later calls first: taking the oldest plan is right only if all are alike
    if plans and all(p.same_as(plans[0]) for p in plans):
        return plans.popleft()
    raise RuntimeError(
        f"{module.signature} is being recomputed during backward, but fp8train cannot tell which "
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
    if inside_reentrant_checkpoint():
        raise RuntimeError(
            "torch.utils.checkpoint(..., use_reentrant=True) over FP8 modules in a training region: "
            "use_reentrant=True is not supported (its forward runs without autograd, so its FP8 "
            "calls cannot be matched to their recomputation). Use fp8train.checkpoint(fn, *args) or "
            "torch.utils.checkpoint(fn, *args, use_reentrant=False)"
        )


# ---- fp8train.checkpoint ---------------------------------------------------------------------------------
class CheckpointRecord:
    """The record of one fp8train.checkpoint call, for its recomputation (not a module's forward call:
    state.ForwardPlan; not a GEMM call: calls.Call).

    The regions active at the call and each FP8 module's plans in order.

    The plans are noted during the original forward; every recomputation replays them from the
    start, so a recomputation (or a second one, with retain_graph) uses exactly the original scales.
    """

    def __init__(self, stack: tuple[RegionSettings, ...]) -> None:
        self.stack = stack
        self.plans: dict[int, list[ForwardPlan]] = {}
        self.cursor: dict[int, int] = {}

    def add(self, module_id: int, plan: ForwardPlan) -> None:
        self.plans.setdefault(module_id, []).append(plan)

    def next(self, module_id: int) -> Optional[ForwardPlan]:
        """The plan of this module's next call in the original forward, or None if it ran no more."""
        index = self.cursor.get(module_id, 0)
        plans = self.plans.get(module_id, [])
        if index >= len(plans):
            return None
        self.cursor[module_id] = index + 1
        return plans[index]


class _Replaying:
    """Context of every recomputation of one checkpoint call (torch enters it again for each one, e.g.
    with retain_graph): replay under the regions that were active at the original call."""

    def __init__(self, record: CheckpointRecord) -> None:
        self.record = record
        self.active: list = []

    def __enter__(self) -> None:
        replaying = STATE.recompute.replay(self.record, STATE.regions)
        replaying.__enter__()
        self.active.append(replaying)
        self.record.cursor = {}

    def __exit__(self, *exc) -> None:
        self.active.pop().__exit__(*exc)


def recomputation_context_fn() -> Callable:
    """`torch.utils.checkpoint`'s context_fn for one fp8train.checkpoint call made now: its forward
    notes the plans of its FP8 calls, each recomputation replays them under the original regions."""
    record = CheckpointRecord(tuple(STATE.regions.stack))

    def context_fn():
        return STATE.recompute.noting_into(record), _Replaying(record)

    return context_fn

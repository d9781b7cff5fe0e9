"""Who may share an amax group (docs/design.md, sections 4 and 8): a rank outside the group, a
tensor-parallel group not inside it, or a group spanning pipeline stages would make ranks cast one
tensor with different scales or pair collectives of different stages. Every check is local and the
same on every rank (no collective), so every rank raises alike before any collective of the region.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .settings import settings

__all__ = [
    "world_if_default", "reduces_across_ranks", "check_amax_group", "check_stage_group", "expert_group_error",
]  # fmt: skip


def world_if_default(process_group):
    if process_group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return process_group


def reduces_across_ranks(recipe, process_group) -> bool:
    if not (recipe.reduce_amax and dist.is_available() and dist.is_initialized()):
        return False
    # A group this rank is not in reports world size -1, which would read as "no reduction" and let
    # the rank train alone, silently, with its own scales.
    if dist.get_rank(process_group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the amax reduction group passed to "
            "fp8_autocast(fp8_group=...); pass a group that contains every rank that runs this region"
        )
    return dist.get_world_size(process_group) > 1 or settings.reduce_single_rank


def check_stage_group(where: str, amax_process_group, reduces: bool, pipeline_group) -> None:
    """The amax group must stay inside one pipeline stage: stages run different modules, at different
    times, so a group spanning them would pair one stage's reductions with another's (or wait for a
    stage that waits for this one's activations). `pipeline_group`: the process group of the
    pipeline (torch.distributed.pipelining's stage group; None: the world), whose other ranks hold
    the other stages. Local and the same on every rank: every rank raises, before any collective."""
    if not reduces:
        return
    me = dist.get_rank()
    stages = set(dist.get_process_group_ranks(pipeline_group or dist.group.WORLD)) - {me}
    shared = sorted(stages & set(dist.get_process_group_ranks(amax_process_group)))
    if shared:
        raise ValueError(
            f"{where}: the amax group (fp8_group / amax_reduction_group) holds ranks {shared} of other "
            f"pipeline stages (rank {me}'s pipeline group: {sorted(stages | {me})}). An amax group must not "
            "span pipeline stages: give each stage its own amax group, the data- and tensor-parallel ranks "
            "of that stage (e.g. dist.new_group(ranks_of_my_stage); fp8train.pipeline.prepare_stage checks "
            "this when the stage is built)"
        )


def check_amax_group(module: torch.nn.Module, amax_process_group, reduces: bool) -> None:
    """The amax group must contain the module's TP group: else the TP ranks would cast the shards of
    one tensor with different scales. Local and the same on every rank (no collective): every rank
    raises alike, before any collective of the region."""
    ep_group = getattr(module, "expert_parallel_group", None)  # set by fp8train.ExpertParallel
    error = expert_group_error(type(module).__name__, amax_process_group, ep_group) if reduces else None
    if error:
        raise ValueError(error)
    tp = getattr(module, "tp", None)
    if tp is None or not tp.active:
        return
    tp_ranks = sorted(dist.get_process_group_ranks(tp.group))
    amax_ranks = sorted(dist.get_process_group_ranks(amax_process_group)) if reduces else []
    if not set(tp_ranks) <= set(amax_ranks):
        group = f"the amax group (fp8_group) holds {amax_ranks}" if reduces else "amaxes are not reduced"
        raise ValueError(
            f"{type(module).__name__}: its tp_group holds ranks {tp_ranks} but {group}: tensor-parallel "
            "ranks would cast shards of one tensor with different scales. Use an fp8_group that contains "
            "every tp_group (TP x DP; the default is all ranks) and not one that spans pipeline stages, "
            "with reduce_amax=True"
        )


def expert_group_error(where: str, amax_process_group, ep_group, recipe=None) -> Optional[str]:
    """The error of an amax group holding other ranks of an expert-parallel group (None: fine, or
    `ep_group` is None). Experts split over `ep_group` are different experts on each of its ranks:
    MAX-reducing their amaxes together would scale each expert from another's. With `recipe`, only
    where it reduces across ranks. Local and the same on every rank of a regular (EP x DP) layout;
    expert_parallel.py agrees it over the EP group before any token moves."""
    if ep_group is None:
        return None
    amax_group, ep_group = world_if_default(amax_process_group), world_if_default(ep_group)
    if recipe is not None and not reduces_across_ranks(recipe, amax_group):
        return None
    amax_ranks = sorted(dist.get_process_group_ranks(amax_group))
    ep_ranks = sorted(dist.get_process_group_ranks(ep_group))
    shared = sorted((set(amax_ranks) & set(ep_ranks)) - {dist.get_rank()})
    if not shared:
        return None
    return (
        f"{where}: the experts are split over ep_group {ep_ranks} (a different expert on each of its ranks) "
        f"but their amax group holds {amax_ranks}, with ep_group ranks {shared}: different experts' amaxes "
        "would be MAX-reduced together and each expert scaled from another's. Give the experts the amax "
        "group of the data-parallel replicas of this rank's experts (ExpertParallel(..., amax_group="
        "dp_group), every rank creating every group; with no replica a single-rank group, or "
        "DelayedScaling(reduce_amax=False)), not the ep_group or the world"
    )

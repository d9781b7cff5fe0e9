"""What FSDP2's FP8 weight gathers ask of delayed scaling (fsdp.py; docs/design.md, section 7): the
region a gather made now is for, the weight scale each shard is cast with before it, and whether a
weight gathered earlier may serve a call now. One door, `fp8_gathers()`, so that fsdp.py reads no
protocol state (regions, settings, amax groups, replays, the role layout). It reads the runtime's
region stack and replays (`fp8train.runtime`) and the amax group the region's settings hold
(`RegionSettings.state`, looked up by `DelayedRuntime.region_state`)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..runtime import STATE, Region, RegionSettings
from ..torch_internals import in_backward
from .roles import WEIGHT, forward_column

__all__ = ["FP8Gathers", "fp8_gathers"]


class FP8Gathers:
    """FSDP2's FP8 weight gathers as the protocol sees them when `fp8_gathers()` was called.

    `region`: the region a gather made now is for: the outermost region being run, where the innermost
    region's recipe casts a weight before its gather (delayed scaling); None: gathered in the parameter
    dtype (outside an FP8 region; other recipes cast the whole weight)."""

    def __init__(self, settings: Optional[RegionSettings], region: Optional[Region]) -> None:
        self._settings = settings
        casts_first = settings is not None and settings.enabled and settings.quantization.casts_before_gather
        self.region = region if casts_first else None

    def weight_scales(
        self, module: torch.nn.Module, gemm_index: int, shard_ranks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, scale_inv) of the weight role of `module`'s GEMM `gemm_index` in `self.region` (not
        None): the scales its forward will cast with (its call's plan takes the same:
        `ScalingMeta.scales_in`). Raises ValueError where the amax group does not contain the ranks
        FSDP2 shards the weight over (each shard would be cast with its own scale)."""
        group = self._settings.state  # the amax group, looked up at the region's entry
        amax_ranks = dist.get_process_group_ranks(group.process_group) if group.fwd.channel else []
        if len(set(shard_ranks)) > 1 and not set(shard_ranks) <= set(amax_ranks):  # one shard: its own
            raise ValueError(
                f"{module.signature} (fsdp_fp8_all_gather): FSDP2 shards its weight over ranks "
                f"{shard_ranks} but the amax group reduces over {amax_ranks or 'no ranks'}: each shard would "
                "be cast with its own scale. Use an fp8_group that contains the sharding group (the default, "
                "all ranks, does) with reduce_amax=True, or build the module without fsdp_fp8_all_gather"
            )
        scale, scale_inv, offset = module.fp8_meta["scaling_fwd"].scales_in(self.region, module)
        column = forward_column(offset, gemm_index, WEIGHT)
        return scale[column], scale_inv[column]

    @staticmethod
    def serves(region: Optional[Region]) -> bool:
        """Whether a weight gathered in FP8 for `region` may serve a call now: gathered for the
        outermost region being run, or a recomputation (in backward, or of fp8train.checkpoint), whose
        re-gather reproduced the original forward's."""
        return region is STATE.regions.region or in_backward() or STATE.recompute.replaying is not None


def fp8_gathers() -> FP8Gathers:
    """How FSDP2 gathers FP8 weights now (fsdp.py)."""
    return FP8Gathers(STATE.regions.settings, STATE.regions.region)

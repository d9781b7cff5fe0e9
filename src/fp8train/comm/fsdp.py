"""FP8 gradient reduce-scatter for FSDP2 (`FSDPModule.set_custom_reduce_scatter`; torch 2.13 has it).
docs/design.md, section 15.

FSDP2 reduce-scatters each parameter group's flat gradient buffer [W * S] into this rank's shard
[S]. Here: every rank sends shard r as FP8 with its chunk scales (wire.encode) to rank r with one
all_to_all; rank r decodes the W contributions and sums them in float32 in rank order 0..W-1 (over
W for an average). There is no return trip (each rank keeps its own shard), so nothing has to agree
across ranks, and no error feedback (FSDP2 reuses no buffer identity a residual could follow).

FSDP2 calls the reduce-scatter in its reduce-scatter stream and waits for nothing it returns, so the
call is synchronous on the host for gloo and stream-ordered on NCCL; it is issued in FSDP2's own
order on FSDP2's group, so no ordering machinery is needed (unlike the DDP hook).
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.distributed as dist

from ..numerics.formats import Format
from . import wire
from .ddp import fp8_encoding

__all__ = ["FP8ReduceScatter", "use_fp8_reduce_scatter"]


class FP8ReduceScatter:
    """A custom FSDP2 reduce-scatter (the interface of torch's `fsdp._fully_shard._fsdp_api.
    ReduceScatter`, duck-typed: that class is private) with FP8 on the wire and float32 sums.
    Install it with `use_fp8_reduce_scatter(model, ...)`.

    Args:
        fp8_format: the wire's encoding: `Format.E4M3` (default), `Format.E5M2`, a name or an FP8 dtype.
        chunk_size: values per scale (one scale per chunk on the wire).
        stochastic_rounding: round stochastically (unbiased), from a generator seeded with `seed` and
            the rank.
        seed: the rounding generator's seed.

    Raises:
        ValueError: an unknown `fp8_format` or a `chunk_size` the wire cannot take.
    """

    def __init__(
        self,
        fp8_format: Union[Format, str, torch.dtype] = Format.E4M3,
        chunk_size: int = 128,
        stochastic_rounding: bool = False,
        seed: int = 0,
    ) -> None:
        self.encoding = fp8_encoding(fp8_format)
        self.chunk_size = wire.checked_chunk_size(chunk_size)
        self.rounding = wire.RoundingGenerators(stochastic_rounding, seed)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer FSDP2 asks for: an empty tensor of `size`, `dtype` on `device`."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op=dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> None:
        if async_op:
            raise NotImplementedError("FP8ReduceScatter runs synchronously (FSDP2 calls it so)")
        average = _is_average(op)
        world, shard = dist.get_world_size(group), output_tensor.numel()
        if input_tensor.numel() != world * shard:
            raise ValueError(
                f"reduce-scatter input has {input_tensor.numel()} elements, expected {world} x {shard}"
            )
        rows = input_tensor.detach().reshape(world, shard).float()
        generator = self.rounding.get(input_tensor.device, dist.get_rank(group))
        sent = wire.encode(rows, self.chunk_size, self.encoding, generator)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
        contributions = wire.decode(received, shard, self.chunk_size, self.encoding)
        total = contributions[0].clone()
        for r in range(1, world):
            total += contributions[r]
        if average:
            total.div_(world)
        with torch.no_grad():
            output_tensor.copy_(total.view_as(output_tensor))


def _is_average(op) -> bool:
    """SUM or AVG; anything else (PREMUL_SUM, which hides its factor) is refused with the fix."""
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    raise ValueError(
        f"FP8ReduceScatter reduces with SUM or AVG, got {op}: FSDP2 passes a pre-multiplied sum when "
        "set_reduce_scatter_divide_factor is set to something other than the world size; leave it unset"
    )


def use_fp8_reduce_scatter(model: torch.nn.Module, **options) -> FP8ReduceScatter:
    """Install one FP8ReduceScatter (options as its constructor's) on every FSDP2 module of `model`
    (`set_custom_reduce_scatter` is per module); returns it."""
    from torch.distributed.fsdp import FSDPModule

    comm = FP8ReduceScatter(**options)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            "use_fp8_reduce_scatter: the model has no fully_shard-ed module; call fully_shard first"
        )
    if not hasattr(modules[0], "set_custom_reduce_scatter"):
        raise RuntimeError(
            f"torch {torch.__version__}'s FSDP2 has no set_custom_reduce_scatter; FP8 reduce-scatter needs a "
            "torch that has it (2.13 does), or use DDP with fp8_allreduce_hook"
        )
    for module in modules:
        module.set_custom_reduce_scatter(comm)
    return comm

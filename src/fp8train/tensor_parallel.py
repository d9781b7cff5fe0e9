"""Tensor and sequence parallelism for FP8 modules (TransformerEngine's arguments): docs/design.md,
section 8.

A column-parallel GEMM holds rows `[r*n/tp, (r+1)*n/tp)` of the weight (output features) and takes a
replicated input; a row-parallel one holds those columns (input features), takes the matching input
shard and sums its partial outputs over the TP group. With sequence parallelism the token dimension
(dim 0) is sharded outside: a column GEMM all-gathers its input (in FP8, cast before the gather, when
it runs in FP8) and a row GEMM reduce-scatters its output. Every FP8 scale is one for the whole
tensor because the amax group contains the TP group (checked in `check_amax_group`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["TensorParallel", "reduce_sequence_parallel_grads"]

MODES = (None, "column", "row")


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """all_gather_single (torch 2.13's name; all_gather_into_tensor before), looked up per call."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, tensor, group=group)


def _reduce_scatter(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, tensor, group=group)


@dataclass(frozen=True)
class TensorParallel:
    """Where a module's GEMM sits in its TP group. `group=None`: not parallel."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    mode: Optional[str]  # "column", "row" or None
    sequence_parallel: bool

    @staticmethod
    def make(tp_group, tp_size, parallel_mode, sequence_parallel, where: str) -> TensorParallel:
        if parallel_mode not in MODES:
            raise ValueError(f"{where}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
        if tp_group is None:
            if tp_size not in (None, 1) or sequence_parallel:
                raise ValueError(
                    f"{where}: tp_size={tp_size}, sequence_parallel={sequence_parallel} need tp_group (the "
                    "tensor-parallel ProcessGroup); pass tp_group, or leave them unset for no parallelism"
                )
            return TensorParallel(None, 1, 0, None, False)
        size = dist.get_world_size(tp_group)
        if tp_size not in (None, size):
            raise ValueError(f"{where}: tp_size={tp_size} but tp_group has {size} ranks; leave tp_size unset")
        if parallel_mode is None:
            raise ValueError(f"{where}: tp_group is set: pass parallel_mode='column' or 'row'")
        return TensorParallel(tp_group, size, dist.get_rank(tp_group), parallel_mode, bool(sequence_parallel))

    @property
    def active(self) -> bool:
        return self.group is not None

    def local(self, n: int, what: str, where: str) -> int:
        if n % self.size:
            raise ValueError(f"{where}: {what}={n} does not divide by the tensor-parallel size {self.size}")
        return n // self.size

    def shard(self, full: torch.Tensor, dim: int, halves: int = 1) -> torch.Tensor:
        """This rank's shard of `full` along `dim` (of each of `halves` equal parts: swiglu's gate
        and up halves are sharded alike), as a tensor of its own."""
        parts = full.chunk(halves, dim)
        return torch.cat([p.chunk(self.size, dim)[self.rank] for p in parts], dim).clone()

    # ---- the collectives around a GEMM ----------------------------------------------------------
    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """A column GEMM's input without sequence parallelism: the same on every rank, whose
        gradient is the sum of the ranks' gradients."""
        if self.mode == "column" and not self.sequence_parallel:
            return _CopyToGroup.apply(x, self.group)
        return x

    def sp_group(self) -> Optional[dist.ProcessGroup]:
        """The TP group over which a column GEMM all-gathers its input's tokens (sequence parallelism)."""
        return self.group if self.mode == "column" and self.sequence_parallel else None

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        """A row GEMM's partial output: summed over the group, or reduce-scattered over tokens."""
        if self.mode != "row":
            return y
        if self.sequence_parallel:
            return TokenCollective.apply(y, self.group, False)
        return _AllReduce.apply(y, self.group)


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather dim 0 over `group` (ranks in order). FP8 values travel as bytes (gloo gathers no
    float8 dtype)."""
    size = dist.get_world_size(group)
    send = x.contiguous()
    wire = send.view(torch.uint8) if send.dtype.itemsize == 1 and send.is_floating_point() else send
    out = wire.new_empty((size * wire.shape[0], *wire.shape[1:]))
    _all_gather(out, wire, group=group)
    return out.view(send.dtype) if wire is not send else out


def check_equal_shards(x: torch.Tensor, group, where: str) -> None:
    """Raise on every rank of `group` unless every rank holds a token shard of the same shape.

    Gathers of different sizes kill the process on gloo and hang or corrupt on NCCL, so the first
    sequence-parallel gather of each module checks this with one small all-reduce (the result is read
    on the host: once per module, not per step)."""
    dims = list(x.shape) + [0] * (8 - x.dim())
    shape = torch.tensor(dims + [-d for d in dims], dtype=torch.int64, device=x.device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
    largest, smallest = shape[:8].tolist(), [-d for d in shape[8:].tolist()]
    if largest != smallest:
        raise ValueError(
            f"{where}: sequence parallelism needs the same token shard shape on every rank of the tp_group; "
            f"this rank has {tuple(x.shape)}, the group's smallest {tuple(smallest[: x.dim()])} and largest "
            f"{tuple(largest[: x.dim()])}. Split the sequence evenly over the TP ranks (pad it to a multiple "
            "of the TP size)"
        )


def gather_fp8_tokens(q: torch.Tensor, group) -> torch.Tensor:
    """All-gather dim 0 of FP8 values (E4M3) at 1 byte each, also when the emulated GEMM holds them
    in a wider dtype (they convert exactly both ways)."""
    if q.dtype.itemsize == 1:
        return gather_tokens(q, group)
    return gather_tokens(q.to(torch.float8_e4m3fn), group).to(q.dtype)


def reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over `group`, each rank keeping its block of dim 0."""
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence parallelism: {x.shape[0]} tokens do not divide by the TP size {size}")
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _reduce_scatter(out, x.contiguous(), group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        if y.is_contiguous():  # the GEMM's fresh output: summed in place
            ctx.mark_dirty(y)
        else:
            y = y.contiguous()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TokenCollective(torch.autograd.Function):
    """Sequence parallelism's pair in high precision: gather a rank's tokens (backward: reduce-scatter
    the gradient), or reduce-scatter partial sums to each rank's tokens (backward: gather)."""

    @staticmethod
    def forward(ctx, x, group, gather: bool):
        ctx.group, ctx.gather = group, gather
        return gather_tokens(x, group) if gather else reduce_scatter_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        grad = reduce_scatter_tokens(grad, ctx.group) if ctx.gather else gather_tokens(grad, ctx.group)
        return grad, None, None


def mark_sequence_parallel(*params: Optional[torch.nn.Parameter]) -> None:
    """Replicated parameters applied to token shards: each rank's gradient is a partial sum."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


def reduce_sequence_parallel_grads(model: torch.nn.Module, tp_group) -> None:
    """Sum over `tp_group` the gradients of the parameters of `model` marked `sequence_parallel` (norm
    weights, row biases under sequence parallelism), in one all-reduce, in place. Call it after
    backward, before the optimizer step (with DDP, before or after its averaging over the
    data-parallel group: the two commute). Collective over `tp_group`; returns None."""
    marked = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [p.grad for p in marked if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))

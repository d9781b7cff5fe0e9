"""fp8train.Linear: torch.nn.Linear with FP8 GEMMs inside an FP8 region."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..fsdp import wrap_for_fsdp
from ..tensor_parallel import TensorParallel, mark_sequence_parallel
from .base import FP8Module
from .fp8_linear import parallel_linear

__all__ = ["Linear", "init_linear_params", "gemm_params"]


def init_linear_params(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """torch.nn.Linear's initialisation."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
        torch.nn.init.uniform_(bias, -bound, bound)


def gemm_params(
    in_features: int,
    out_features: int,
    bias: bool,
    params_dtype: Optional[torch.dtype],
    device,
    tp: TensorParallel,
    where: str,
    fsdp_gemm: Optional[int] = None,
    halves: int = 1,
) -> tuple[torch.nn.Parameter, Optional[torch.nn.Parameter]]:
    """A GEMM's weight (out x in) and bias, initialised as torch.nn.Linear does. Tensor-parallel ranks
    initialise the whole weight alike (same seed, same values) and keep their shard: rows for a column
    GEMM (of each of `halves` parts), columns for a row GEMM, whose bias stays whole (and, under
    sequence parallelism, is marked: it applies to this rank's tokens). `fsdp_gemm`: the GEMM index
    under which FSDP2 gathers the weight in FP8 (fsdp_fp8_all_gather), None for a plain gather."""
    kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
    weight = torch.empty(out_features, in_features, **kw)
    b = torch.empty(out_features, **kw) if bias else None
    init_linear_params(weight, b)
    if tp.mode == "column":
        tp.local(out_features // halves, "out_features", where)
        weight, b = tp.shard(weight, 0, halves), None if b is None else tp.shard(b, 0, halves)
    elif tp.mode == "row":
        tp.local(in_features, "in_features", where)
        weight = tp.shard(weight, 1)
    weight, b = torch.nn.Parameter(weight), None if b is None else torch.nn.Parameter(b)
    if tp.mode == "row" and tp.sequence_parallel:
        mark_sequence_parallel(b)
    if fsdp_gemm is not None:
        wrap_for_fsdp(weight, fsdp_gemm)
    return weight, b


class Linear(FP8Module):
    """y = x @ weight.T + bias with FP8 GEMMs inside an FP8 region; tensor parallel with `tp_group`
    and `parallel_mode` (column: this rank's output features; row: its input features, the output
    summed over the group), sequence parallel with `sequence_parallel=True` (docs/design.md, section 8)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fsdp_fp8_all_gather: bool = False,
        tp_group=None,
        tp_size: Optional[int] = None,
        parallel_mode: Optional[str] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp = TensorParallel.make(tp_group, tp_size, parallel_mode, sequence_parallel, "Linear")
        self.weight, self.bias = gemm_params(
            in_features, out_features, bias, params_dtype, device, self.tp, "Linear",
            fsdp_gemm=0 if fsdp_fp8_all_gather else None,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        return parallel_linear(self, x, self.weight, self.bias, 0, is_first_microbatch, self.tp)

    def extra_repr(self) -> str:
        tp = f", parallel_mode={self.tp.mode}, tp_size={self.tp.size}" if self.tp.active else ""
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, bias={self.bias is not None}{tp}"

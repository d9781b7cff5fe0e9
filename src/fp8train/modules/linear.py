"""fp8train.Linear: torch.nn.Linear with FP8 GEMMs inside an FP8 region."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..fsdp import wrap_for_fsdp
from ..tensor_parallel import TensorParallel, mark_sequence_parallel
from .base import FP8Module
from .fp8_linear import parallel_linear

__all__ = ["Linear", "init_linear_params", "gemm_params", "reset_gemm_params"]


def init_linear_params(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """torch.nn.Linear's initialisation."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
        torch.nn.init.uniform_(bias, -bound, bound)


def _local_init(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype,
    device,
    tp: TensorParallel,
    where: str,
    halves: int,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """This rank's initial weight (out x in) and bias: torch.nn.Linear's initialisation of the whole
    GEMM (same seed, same values on every TP rank), then this rank's shard of it: rows for a column
    GEMM (of each of `halves` parts), columns for a row GEMM, whose bias stays whole."""
    weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
    b = torch.empty(out_features, dtype=dtype, device=device) if bias else None
    init_linear_params(weight, b)
    if tp.mode == "column":
        tp.local(out_features // halves, "out_features", where)
        weight, b = tp.shard(weight, 0, halves), None if b is None else tp.shard(b, 0, halves)
    elif tp.mode == "row":
        tp.local(in_features, "in_features", where)
        weight = tp.shard(weight, 1)
    return weight, b


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
    """A GEMM's weight (out x in) and bias, initialised as torch.nn.Linear does, sharded for tensor
    parallelism (`_local_init`); a row GEMM's bias under sequence parallelism is marked (it applies to
    this rank's tokens). `fsdp_gemm`: the GEMM index under which FSDP2 gathers the weight in FP8
    (fsdp_fp8_all_gather), None for a plain gather."""
    dtype = params_dtype or torch.get_default_dtype()
    weight, b = _local_init(in_features, out_features, bias, dtype, device, tp, where, halves)
    weight, b = torch.nn.Parameter(weight), None if b is None else torch.nn.Parameter(b)
    if tp.mode == "row" and tp.sequence_parallel:
        mark_sequence_parallel(b)
    if fsdp_gemm is not None:
        wrap_for_fsdp(weight, fsdp_gemm)
    return weight, b


def reset_gemm_params(
    weight: torch.Tensor, bias: Optional[torch.Tensor], tp: TensorParallel, where: str, halves: int = 1
) -> None:
    """Initialise a GEMM's parameters again, in place, to what construction gives from the same seed
    (the FSDP2 meta-device pattern: build on "meta", `to_empty`, then `reset_parameters()`).

    The whole GEMM is drawn on every rank, so a parameter FSDP2 has sharded (a DTensor) receives its
    shard of the very weight an unsharded build draws."""
    out_features = weight.shape[0] * (tp.size if tp.mode == "column" else 1)
    in_features = weight.shape[1] * (tp.size if tp.mode == "row" else 1)
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    w, b = _local_init(
        in_features, out_features, bias is not None, weight.dtype, local.device, tp, where, halves
    )
    with torch.no_grad():
        for param, value in ((weight, w), (bias, b)):
            if param is not None:
                param.copy_(_like(param, value))


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a whole tensor, the same on every rank) laid out as `param`: as is, or as the DTensor
    FSDP2 made of it, without communication."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, mesh, param.placements, src_data_rank=None)


class Linear(FP8Module):
    """y = x @ weight.T + bias with FP8 GEMMs inside an FP8 region (TransformerEngine's `Linear`);
    `torch.nn.Linear`'s parameters and initialisation, tensor and sequence parallel on request.

    A weight whose dimensions are not multiples of 16 runs in high precision, on every device, with
    one warning (FP8 GEMMs need multiples of 16; fp8train/shape_rule.py).

    Args:
        in_features: the input's last dimension (the whole layer's, also under tensor parallelism).
        out_features: the output's last dimension (the whole layer's).
        bias: whether the layer has a bias.
        params_dtype: the parameters' dtype (default: `torch.get_default_dtype()`).
        device: where the parameters are made ("meta" for FSDP2's pattern: `to_empty`, then
            `reset_parameters()`).
        fsdp_fp8_all_gather: FSDP2 (`fully_shard`) gathers the weight in FP8, cast on each shard
            (docs/guide.md, "FSDP2 with FP8 all-gather").
        tp_group: the tensor-parallel process group (None: no tensor parallelism).
        tp_size: the group's size (default: read from `tp_group`; given, it is checked against it).
        parallel_mode: with `tp_group`: "column" (this rank holds output features) or "row" (its input
            features; the output is summed over the group).
        sequence_parallel: with `tp_group`, the input (column) or output (row) is this rank's block of
            tokens (the sequence dimension is sharded across the group; docs/design.md, section 8).

    Raises:
        ValueError: a tensor-parallel argument that does not fit (the message says which).
    """

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

    def reset_parameters(self) -> None:
        """The initialisation of construction, again (torch.nn.Linear's, from the current seed)."""
        reset_gemm_params(self.weight, self.bias, self.tp, "Linear")
        self.forget_cached_weights()

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """x @ weight.T + bias.

        Args:
            x: the input, (..., in_features) in any float dtype.
            is_first_microbatch: None (the default): the weight cast at every call; True: cast, and the
                FP8 weight kept for the step's next microbatches; False: the kept FP8 weight reused
                (TransformerEngine's argument: gradient accumulation with weights constant in a step).

        Returns:
            (..., out_features) in `x`'s dtype, or torch.autocast's where it is on: computed in FP8 inside an
            FP8 region (`fp8_autocast`), in high precision outside one.
        """
        return parallel_linear(self, x, self.weight, self.bias, 0, is_first_microbatch, self.tp)

    def extra_repr(self) -> str:
        tp = f", parallel_mode={self.tp.mode}, tp_size={self.tp.size}" if self.tp.active else ""
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, bias={self.bias is not None}{tp}"

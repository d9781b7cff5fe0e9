"""LayerNormLinear and LayerNormMLP: a norm followed by FP8 GEMMs."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from .. import second_order
from ..numerics.formats import fp8_max
from ..quantization.block_scaling import TILE
from ..quantization.current import scale_from_amax
from ..runtime import begin_call
from ..saved import decode_fp8
from ..tensor_parallel import TensorParallel, mark_sequence_parallel
from .base import FP8Module
from .fp8_linear import parallel_linear
from .linear import gemm_params, reset_gemm_params
from .norms import make_norm

__all__ = ["LayerNormLinear", "LayerNormMLP"]

ACTIVATIONS = ("gelu", "swiglu")


class LayerNormLinear(FP8Module):
    """norm(x) @ weight.T + bias, the GEMM in FP8 inside an FP8 region; parameters named as in
    TransformerEngine's `LayerNormLinear` (`norm.weight`, `weight`, `bias`).

    Args:
        in_features: the input's last dimension (normalised).
        out_features: the output's last dimension (the whole layer's).
        eps: the norm's epsilon.
        bias: whether the GEMM has a bias.
        normalization: "LayerNorm" or "RMSNorm".
        params_dtype: the parameters' dtype (default: `torch.get_default_dtype()`).
        device: where the parameters are made ("meta" for FSDP2's pattern: `to_empty`, then
            `reset_parameters()`).
        fsdp_fp8_all_gather: FSDP2 (`fully_shard`) gathers the weight in FP8, cast on each shard
            (docs/guide.md, "FSDP2 with FP8 all-gather").
        tp_group: the tensor-parallel process group (None: no tensor parallelism).
        tp_size: the group's size (default: read from `tp_group`; given, it is checked against it).
        parallel_mode: "column" (the default with `tp_group`: this rank holds output features); "row"
            is refused: it would normalise a sharded hidden dimension.
        sequence_parallel: with `tp_group`, the input is this rank's block of tokens (the sequence
            dimension is sharded across the group; docs/design.md, section 8).

    Raises:
        ValueError: `parallel_mode="row"`, an unknown `normalization`, or tensor-parallel arguments
            that do not fit.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fsdp_fp8_all_gather: bool = False,
        tp_group=None,
        tp_size: Optional[int] = None,
        parallel_mode: Optional[str] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        if parallel_mode == "row":
            raise ValueError(
                "LayerNormLinear: parallel_mode='row' would normalise a sharded hidden dimension; use "
                "parallel_mode='column', or a norm followed by a row-parallel fp8train.Linear"
            )
        mode = parallel_mode or ("column" if tp_group is not None else None)
        self.tp = TensorParallel.make(tp_group, tp_size, mode, sequence_parallel, "LayerNormLinear")
        self.norm = make_norm(normalization, in_features, eps, params_dtype, device)
        self.weight, self.bias = gemm_params(
            in_features, out_features, bias, params_dtype, device, self.tp, "LayerNormLinear",
            fsdp_gemm=0 if fsdp_fp8_all_gather else None,
        )  # fmt: skip
        if self.tp.sequence_parallel:  # the norm runs on this rank's tokens
            mark_sequence_parallel(*self.norm.parameters())

    def reset_parameters(self) -> None:
        """The initialisation of construction, again (norm, then the GEMM, from the current seed)."""
        self.norm.reset_parameters()
        reset_gemm_params(self.weight, self.bias, self.tp, "LayerNormLinear")
        self.forget_cached_weights()

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """norm(x) @ weight.T + bias.

        Args:
            x: the input, (..., in_features) in any float dtype.
            is_first_microbatch: None (the default): the weight cast at every call; True: cast, and the
                FP8 weight kept for the step's next microbatches; False: the kept FP8 weight reused
                (TransformerEngine's argument: gradient accumulation with weights constant in a step).

        Returns:
            (..., out_features) in `x`'s dtype, or torch.autocast's where it is on: computed in FP8 inside an
            FP8 region (`fp8_autocast`), in high precision outside one.
        """
        return parallel_linear(self, self.norm(x), self.weight, self.bias, 0, is_first_microbatch, self.tp)


class _ActivationSavedFP8(torch.autograd.Function):
    """act(h) that keeps h for backward as E4M3 bytes with one power-of-2 scale per 1x128 tile of its
    last dimension (per row where that is not a whole number of tiles), and differentiates act at
    those values (docs/design.md, section 17)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, act) -> torch.Tensor:
        rows, cols = h.numel() // h.shape[-1], h.shape[-1]
        tiles = h.detach().float().reshape(rows, -1, TILE if cols % TILE == 0 else cols)
        scale = scale_from_amax(tiles.abs().amax(-1, keepdim=True), fp8_max("e4m3"), power_2=True)
        # |tiles * scale| <= 448 (scale rounded down), so torch's cast (nearest even) does not overflow
        ctx.save_for_backward((tiles * scale).to(torch.float8_e4m3fn), scale.reciprocal())
        ctx.act, ctx.shape, ctx.dtype = act, h.shape, h.dtype
        return act(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():
            second_order.refuse_create_graph("an activation whose input was saved in FP8")
        codes, scale_inv = ctx.saved_tensors
        h = (decode_fp8(codes, torch.float32) * scale_inv).view(ctx.shape).to(ctx.dtype).requires_grad_()
        with torch.enable_grad():
            (grad_h,) = torch.autograd.grad(ctx.act(h), h, grad)
        return grad_h, None


class LayerNormMLP(FP8Module):
    """fc2(act(fc1(norm(x)))) with two FP8 GEMMs; `swiglu` splits fc1's output in two halves. With
    `tp_group` fc1 is column-parallel and fc2 row-parallel (swiglu: each rank holds matching shards
    of the gate and up halves). `save_activation_input_fp8`: in FP8 training, the activation's input
    (fc1's output, the block's largest saved tensor) is kept for backward as E4M3 in 1x128 tiles,
    not in high precision (a quarter of fp32's bytes; the activation's gradient is taken there).
    Parameters named as in TransformerEngine's `LayerNormMLP` (`fc1_weight`, `fc2_bias`, ...).

    Args:
        hidden_size: the input's and output's last dimension.
        ffn_hidden_size: fc1's output features (per half for swiglu) and fc2's input features.
        eps: the norm's epsilon.
        bias: whether fc1 and fc2 have biases.
        normalization: "LayerNorm" or "RMSNorm".
        activation: "gelu" (tanh approximation) or "swiglu".
        params_dtype: the parameters' dtype (default: `torch.get_default_dtype()`).
        device: where the parameters are made ("meta" for FSDP2's pattern: `to_empty`, then
            `reset_parameters()`).
        fsdp_fp8_all_gather: FSDP2 (`fully_shard`) gathers the weights in FP8, cast on each shard
            (docs/guide.md, "FSDP2 with FP8 all-gather").
        tp_group: the tensor-parallel process group (None: no tensor parallelism).
        tp_size: the group's size (default: read from `tp_group`; given, it is checked against it).
        sequence_parallel: with `tp_group`, the input and output are this rank's block of tokens (the sequence
            dimension is sharded across the group; docs/design.md, section 8).
        save_activation_input_fp8: as above (False by default).

    Raises:
        ValueError: an unknown `activation` or `normalization`, a `save_activation_input_fp8` that is
            not a bool, or tensor-parallel arguments that do not fit.
    """

    num_gemms = 2
    gemm_names = ("fc1", "fc2")

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fsdp_fp8_all_gather: bool = False,
        tp_group=None,
        tp_size: Optional[int] = None,
        sequence_parallel: bool = False,
        save_activation_input_fp8: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(save_activation_input_fp8, bool):
            raise ValueError(
                f"save_activation_input_fp8 must be True or False, got {save_activation_input_fp8!r}"
            )
        self.save_activation_input_fp8 = save_activation_input_fp8
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        mode = "column" if tp_group is not None else None
        self.tp = TensorParallel.make(tp_group, tp_size, mode, sequence_parallel, "LayerNormMLP")
        self.tp_fc2 = dataclasses.replace(self.tp, mode="row" if self.tp.active else None)
        halves = 2 if activation == "swiglu" else 1
        self.tp.local(ffn_hidden_size, "ffn_hidden_size", "LayerNormMLP")  # fc1's rows, fc2's columns
        self.norm = make_norm(normalization, hidden_size, eps, params_dtype, device)
        hidden, ffn, where = hidden_size, ffn_hidden_size, "LayerNormMLP"
        gather = fsdp_fp8_all_gather
        self.fc1_weight, self.fc1_bias = gemm_params(
            hidden, halves * ffn, bias, params_dtype, device, self.tp, where, 0 if gather else None, halves
        )
        self.fc2_weight, self.fc2_bias = gemm_params(
            ffn, hidden, bias, params_dtype, device, self.tp_fc2, where, 1 if gather else None
        )
        if self.tp.sequence_parallel:  # the norm applies to this rank's tokens
            mark_sequence_parallel(*self.norm.parameters())

    def reset_parameters(self) -> None:
        """The initialisation of construction, again (norm, fc1, fc2, from the current seed)."""
        self.norm.reset_parameters()
        halves = 2 if self.activation == "swiglu" else 1
        reset_gemm_params(self.fc1_weight, self.fc1_bias, self.tp, "LayerNormMLP", halves)
        reset_gemm_params(self.fc2_weight, self.fc2_bias, self.tp_fc2, "LayerNormMLP")
        self.forget_cached_weights()

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """fc2(act(fc1(norm(x)))).

        Args:
            x: the input, (..., hidden_size) in any float dtype.
            is_first_microbatch: None (the default): the weights cast at every call; True: cast, and the
                FP8 weights kept for the step's next microbatches; False: the kept FP8 weights reused
                (TransformerEngine's argument: gradient accumulation with weights constant in a step).

        Returns:
            (..., hidden_size) in `x`'s dtype, or torch.autocast's where it is on: computed in FP8 inside an
            FP8 region (`fp8_autocast`), in high precision outside one.
        """
        first = is_first_microbatch
        h = parallel_linear(self, self.norm(x), self.fc1_weight, self.fc1_bias, 0, first, self.tp)
        saves_fp8 = self.save_activation_input_fp8 and h.requires_grad and begin_call(self, 1).fp8
        a = _ActivationSavedFP8.apply(h, self._act) if saves_fp8 else self._act(h)
        return parallel_linear(self, a, self.fc2_weight, self.fc2_bias, 1, first, self.tp_fc2)

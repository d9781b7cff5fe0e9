"""fp8train.StoredFP8Experts: transformers' fused MoE experts (Qwen3-MoE, Mixtral) whose weights are
stored block-FP8 operands (a published checkpoint's per-expert `weight` and `weight_scale_inv`),
frozen, with no high-precision copy: StoredFP8Linear's rules for E experts (docs/design.md, section
9.2, "Stored FP8 experts").

The tensors are transformers' FP8 experts layout (its `FP8Experts`): `gate_up_proj` float8_e4m3fn
(E, 2I, H), gate and up of each expert concatenated along the rows, `down_proj` (E, H, I), and one
float32 `*_scale_inv` per 128x128 block of each expert: (E, 2 ceil(I/128), ceil(H/128)) and
(E, ceil(H/128), ceil(I/128)). Expert e's gate_up is then the operand (gate_up_proj[e],
gate_up_proj_scale_inv[e]) as it stands, which needs I to be whole blocks (a partial block of gate
would share its scale with rows of up): other I are refused. Each expert's GEMMs are GEMMs of the
module, gate_up of expert e GEMM e and its down_proj GEMM E + e (FusedExperts' layout), each a
StoredFP8Linear's: the stored operand used as it is inside an FP8 region (nothing cast, cached or
recorded for it), the dequantized weight outside one, the input gradient only.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch

from ..quantization.base import WeightOperands
from ..quantization.stored_block_weights import (
    BLOCK,
    DEFAULT_RECIPE,
    BlockFormatError,
    check_scale_values,
    check_stored_weight,
    dequantize_block_weight,
    scale_grid,
    scales_to_float32,
    stored_operand,
)
from ..recipe import Float8BlockScaling
from .base import FP8Module
from .fp8_linear import fp8_linear
from .grouped_linear import group_block, pad_groups, unpad_groups
from .stored_linear import StoredFP8Parameters

__all__ = ["StoredFP8Experts", "PROJECTIONS"]

# the names of an expert's three linears in per-expert checkpoints: DeepSeek-V3 / Qwen3-MoE, Mixtral
PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
ExpertTensors = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (FP8 weight, scale_inv) per expert


class StoredFP8Experts(StoredFP8Parameters, FP8Module):
    """Frozen FP8 experts with transformers' fused-experts forward `(hidden_states, top_k_index,
    top_k_weights)`: act(x W_gate^T) * (x W_up^T), then W_down, weighted by the routing weights and
    summed over a token's experts, the tokens in transformers' loop order (FusedExperts'). Every
    weight is its stored block-FP8 operand (module docstring); the routing is untouched.

    Args:
        gate_up_proj: float8_e4m3fn (E, 2I, H), I a multiple of 128.
        gate_up_proj_scale_inv: (E, 2 ceil(I/128), ceil(H/128)): float32, or E8M0 (float8_e8m0fnu or
            uint8 exponent bytes, converted to float32 here); finite and positive.
        down_proj: float8_e4m3fn (E, H, I).
        down_proj_scale_inv: (E, ceil(H/128), ceil(I/128)).
        act_fn: the activation of gate (transformers' `experts.act_fn`).
        compute_dtype: the high-precision dtype of the model around it.
        recipe: the block recipe of the stored format (what would quantize a new weight).
        name: what error messages call the experts (their module name in the model).
        checkpoint_names: the (gate, up, down) names of the per-expert tensors it was loaded from
            (`"<prefix>.<e>.<gate>.weight"`), which an export writes again (`PROJECTIONS`).
        checkpoint_prefix: the `<prefix>` of those tensors where it is not the module's name in the
            model (Mixtral's original `block_sparse_moe.experts`).

    Raises:
        BlockFormatError (a ValueError): a tensor of the wrong dtype or shape, I off the blocks, a
            scale that is not finite and positive (the message names the tensor)."""

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        gate_up_proj_scale_inv: torch.Tensor,
        down_proj: torch.Tensor,
        down_proj_scale_inv: torch.Tensor,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        compute_dtype: torch.dtype = torch.float32,
        recipe: Float8BlockScaling = DEFAULT_RECIPE,
        name: str = "experts",
        checkpoint_names: tuple[str, str, str] = PROJECTIONS[0],
        checkpoint_prefix: Optional[str] = None,
    ) -> None:
        num_experts = _check_experts(
            name, gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv
        )
        self.num_gemms = 2 * num_experts  # before FP8Module's init: it sizes the role layout
        self.gemm_names = tuple(f"gate_up{e}" for e in range(num_experts)) + tuple(
            f"down{e}" for e in range(num_experts)
        )
        super().__init__()
        scales = []
        for key, scale in (("gate_up_proj", gate_up_proj_scale_inv), ("down_proj", down_proj_scale_inv)):
            scale = scales_to_float32(scale, f"{name}.{key}_scale_inv")
            check_scale_values(scale, f"{name}.{key}_scale_inv")
            scales.append(scale)
        self.num_experts = num_experts
        self.hidden_dim, self.intermediate_dim = down_proj.shape[1], down_proj.shape[2]
        self.gate_up_proj = torch.nn.Parameter(gate_up_proj, requires_grad=False)
        self.gate_up_proj_scale_inv = torch.nn.Parameter(scales[0], requires_grad=False)
        self.down_proj = torch.nn.Parameter(down_proj, requires_grad=False)
        self.down_proj_scale_inv = torch.nn.Parameter(scales[1], requires_grad=False)
        self.act_fn = act_fn
        self.compute_dtype = compute_dtype
        self.recipe = recipe
        self.checkpoint_names, self.checkpoint_prefix = tuple(checkpoint_names), checkpoint_prefix

    @classmethod
    def from_expert_tensors(
        cls,
        gate: ExpertTensors,
        up: ExpertTensors,
        down: ExpertTensors,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        compute_dtype: torch.dtype = torch.float32,
        recipe: Float8BlockScaling = DEFAULT_RECIPE,
        name: str = "experts",
        checkpoint_names: tuple[str, str, str] = PROJECTIONS[0],
        checkpoint_prefix: Optional[str] = None,
    ) -> StoredFP8Experts:
        """The experts of per-expert stored tensors (DeepSeek-V3's layout: each expert's gate, up and
        down linears, a 2-D FP8 weight and its scale_inv each), stacked into the fused layout.
        `gate`, `up`, `down`: (weight, scale_inv) of each expert, in expert order; `act_fn`,
        `compute_dtype`, `recipe`, `name`, `checkpoint_names` and `checkpoint_prefix` as the
        constructor's.
        Messages name a weight by its checkpoint key, `"<checkpoint_prefix or name>.<e>.<projection>.weight"`.
        Every tensor is checked before anything is stacked."""
        prefix = checkpoint_prefix or name

        def where(proj: str, e: int) -> str:
            return f"{prefix}.{e}.{proj}.weight"

        if not (len(gate) == len(up) == len(down)) or not gate:
            raise BlockFormatError(
                f"{name}: {len(gate)} gate, {len(up)} up and {len(down)} down tensors: every expert "
                "needs all three"
            )
        checked = []
        for proj, tensors in zip(checkpoint_names, (gate, up, down)):
            floats = []
            for e, (weight, scale) in enumerate(tensors):
                check_stored_weight(where(proj, e), weight, scale)
                scale = scales_to_float32(scale, where(proj, e) + "_scale_inv")
                check_scale_values(scale, where(proj, e) + "_scale_inv")
                floats.append((weight, scale))
            checked.append(floats)
        (gate, up, down), g_name = checked, checkpoint_names[0]
        first = gate[0][0].shape
        for e in range(len(gate)):
            expected = (first, first, torch.Size(first[::-1]))
            for proj, (weight, _), shape in zip(checkpoint_names, (gate[e], up[e], down[e]), expected):
                if weight.shape != shape:
                    raise BlockFormatError(
                        f"{where(proj, e)} has shape {tuple(weight.shape)}, but expert 0's gate "
                        f"{tuple(first)} makes it {tuple(shape)}: every expert has the "
                        "same shapes (gate and up (I, H), down (H, I))"
                    )
        intermediate = gate[0][0].shape[0]
        if intermediate % BLOCK[0]:
            raise BlockFormatError(
                f"{where(g_name, 0)} has {intermediate} rows (the experts' intermediate size), not a "
                f"multiple of {BLOCK[0]}: fused experts hold gate and up in one tensor of 128x128 blocks "
                "(transformers' FP8 experts layout), where a partial block would span both. Such experts "
                "cannot be stored fused"
            )
        gate_up = torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(gate, up)])
        gate_up_scale = torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(gate, up)])
        down_weight = torch.stack([d[0] for d in down])
        down_scale = torch.stack([d[1] for d in down])
        return cls(
            gate_up, gate_up_scale, down_weight, down_scale, act_fn, compute_dtype, recipe, name,
            checkpoint_names, checkpoint_prefix,
        )  # fmt: skip

    def expert_tensors(self, prefix: str) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(checkpoint key of the weight, FP8 weight, float32 scale_inv) of each expert's gate, up and
        down, per expert, for the module named `prefix` in its model (`checkpoint_prefix` instead if
        set): views of the stored tensors, the bytes loaded (what an export writes)."""
        prefix, (gate, up, down) = self.checkpoint_prefix or prefix, self.checkpoint_names
        rows, scale_rows = self.intermediate_dim, self.intermediate_dim // BLOCK[0]
        for e in range(self.num_experts):
            yield (
                f"{prefix}.{e}.{gate}.weight",
                self.gate_up_proj[e, :rows],
                self.gate_up_proj_scale_inv[e, :scale_rows],
            )
            yield (
                f"{prefix}.{e}.{up}.weight",
                self.gate_up_proj[e, rows:],
                self.gate_up_proj_scale_inv[e, scale_rows:],
            )
            yield f"{prefix}.{e}.{down}.weight", self.down_proj[e], self.down_proj_scale_inv[e]

    def operand(self, gemm: int) -> WeightOperands:
        """GEMM `gemm`'s stored weight as its operand (views of the parameters)."""
        if gemm < self.num_experts:
            weight, scale = self.gate_up_proj[gemm], self.gate_up_proj_scale_inv[gemm]
        else:
            weight, scale = (
                self.down_proj[gemm - self.num_experts],
                self.down_proj_scale_inv[gemm - self.num_experts],
            )
        return WeightOperands.same(stored_operand(weight, scale))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) as the experts multiply them, in float32 (new tensors)."""
        return tuple(
            torch.stack([dequantize_block_weight(w, s) for w, s in zip(weight, scale)])
            for weight, scale in (
                (self.gate_up_proj, self.gate_up_proj_scale_inv),
                (self.down_proj, self.down_proj_scale_inv),
            )
        )

    def gemm_weights(self) -> list[torch.Tensor]:
        """The FP8 weight of each GEMM, in GEMM order (coverage: frozen GEMMs)."""
        return list(self.gate_up_proj.unbind(0)) + list(self.down_proj.unbind(0))

    def gemm_tokens(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, *args, **kwargs
    ) -> list[int]:
        """The rows each GEMM of a call `forward(hidden_states, top_k_index, ...)` multiplies."""
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts + 1)[: self.num_experts]
        return counts.tolist() * 2

    def _experts_gemm(self, x: torch.Tensor, counts: list[int], first: int) -> torch.Tensor:
        """The rows of `x` in groups of `counts`, group e multiplied by the stored weight of GEMM
        first + e; each group padded to whole blocks where the region's recipe needs them (MXFP8, NVFP4)."""
        block, splits = group_block(self), counts
        if block > 1 and any(n % block for n in counts):
            x, splits = pad_groups(x, counts, block)
        outs = []
        for e, rows in enumerate(x.split(splits)):
            ops = self.operand(first + e)
            outs.append(fp8_linear(self, rows, ops.forward.values, None, first + e, stored_weight=ops))
        return unpad_groups(torch.cat(outs), counts, splits)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """transformers' experts forward: `hidden_states` (tokens, H), `top_k_index` (tokens, k) each
        token's experts (E: none), `top_k_weights` (tokens, k) their routing weights. Returns
        (tokens, H), the weighted sum of each token's experts."""
        tokens, _ = top_k_index.shape
        with torch.no_grad():  # transformers' loop order: expert, then top-k position, then token
            flat = top_k_index.t().reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts].tolist()
            routed = sum(counts)  # rows routed to no expert (index E) add nothing
            token_idx, position = order[:routed] % tokens, order[:routed] // tokens
        gate, up = self._experts_gemm(hidden_states[token_idx], counts, 0).chunk(2, dim=-1)
        h = self._experts_gemm(self.act_fn(gate) * up, counts, self.num_experts)
        h = h * top_k_weights[token_idx, position, None]
        final = torch.zeros_like(hidden_states)
        return final.index_add_(0, token_idx, h.to(final.dtype))

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
            f"intermediate={self.intermediate_dim}, weights=float8_e4m3fn in 128x128 blocks"
        )


def _check_experts(name, gate_up, gate_up_scale, down, down_scale) -> int:
    """The number of experts of the fused tensors, or a BlockFormatError naming the one that does not fit."""
    for key, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 3:
            raise BlockFormatError(
                f"{name}.{key} is {weight.dtype} {tuple(weight.shape)}: stored experts are float8_e4m3fn "
                "(experts, out, in)"
            )
    experts, hidden, intermediate = down.shape
    if tuple(gate_up.shape) != (experts, 2 * intermediate, hidden):
        raise BlockFormatError(
            f"{name}.gate_up_proj has shape {tuple(gate_up.shape)}, but down_proj {tuple(down.shape)} "
            f"makes it {(experts, 2 * intermediate, hidden)} (experts, 2 x intermediate, hidden)"
        )
    if intermediate % BLOCK[0]:
        raise BlockFormatError(
            f"{name}: intermediate size {intermediate} is not a multiple of {BLOCK[0]}: fused experts "
            "hold gate and up in one tensor of 128x128 blocks (transformers' FP8 experts layout), where a "
            "partial block would span both"
        )
    gate_up_grid = (experts, *scale_grid(2 * intermediate, hidden))
    down_grid = (experts, *scale_grid(hidden, intermediate))
    for key, scale, grid in (
        ("gate_up_proj", gate_up_scale, gate_up_grid),
        ("down_proj", down_scale, down_grid),
    ):
        if tuple(scale.shape) != grid:
            raise BlockFormatError(
                f"{name}.{key}_scale_inv has shape {tuple(scale.shape)}, but {name}.{key} in 128x128 blocks "
                f"needs {grid} (experts, ceil(out/128), ceil(in/128))"
            )
    return experts

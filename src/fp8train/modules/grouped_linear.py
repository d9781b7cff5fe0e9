"""Grouped FP8 GEMMs for mixture-of-experts layers (docs/design.md, section 9, "Grouped GEMMs").

A grouped linear layer is one FP8 module with one GEMM per group (expert): GEMM `i` multiplies the
rows of group `i` by weight `i`, and each GEMM index has its own roles (input, weight, output
forward; grad_output, grad_input backward) in the module's `fp8_meta`, as LayerNormMLP's fc1 and fc2
do. So under delayed scaling each expert's tensors have their own amax histories and scales, all
of them columns of the amax group's storage: still one fused update and one collective per region
and direction, whatever the number of experts (docs/design.md, sections 2 and 3).

Each group's GEMMs are `fp8_linear`'s, called with the group's rows and GEMM index: the emulated
path is, by construction, a loop of `fp8train.Linear` calls with the same scales (bit for bit), and
every recipe, the weight cache (`is_first_microbatch`) and recomputation work as for a Linear. An
expert that received no token is a Linear called with 0 rows: its weight is cast (its amax
recorded), its input and grad_output record amax 0, so their histories do not roll (section 1).

Groups and block recipes (what `check_group_blocks` enforces):
- delayed, current and Float8BlockScaling: any token count. Block scaling's 1x128 tiles along the
  tokens (the weight gradient's reduction) end in a partial tile, scaled from its own elements, as
  for a Linear;
- MXFP8 (32) and NVFP4 (16): every group's token count must be a multiple of the block, as the
  recipe requires of a Linear's tokens and as TransformerEngine (its Fp8Padding) and torchao (token
  groups aligned when tokens are permuted) require of grouped GEMMs: fp8train refuses other counts
  rather than pad silently; `pad_groups` pads the groups with zero rows, `unpad_groups` undoes it.
  The converted experts (grouped_experts.py, integrations/torchtitan.py) own their grouping and pad.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..debug_switches import SWITCHES
from ..runtime import current_settings
from ..tensor_parallel import TensorParallel
from .base import FP8Module
from .fp8_linear import fp8_linear
from .grouped_gemm import GroupedGEMMs
from .linear import gemm_params, reset_gemm_params

__all__ = [
    "GroupedLinear", "grouped_fp8_linear", "splits_of", "splits_from_offsets", "check_group_blocks",
    "group_block", "pad_groups", "unpad_groups",
]  # fmt: skip

Splits = Union[Sequence[int], torch.Tensor]


def splits_of(m_splits: Splits, groups: int, tokens: int, where: str) -> list[int]:
    """`m_splits` (rows per group: a sequence of ints, or a 1-D integer tensor, read on the host) as a
    list of `groups` non-negative ints summing to `tokens`; a clear error otherwise."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.is_complex():
            raise ValueError(
                f"{where}: m_splits must be a 1-D integer tensor, got {m_splits.dtype} {m_splits.shape}"
            )
        m_splits = m_splits.tolist()  # a host read: the groups' rows are host ints for the GEMM calls
    splits = list(m_splits)
    if len(splits) != groups or not all(isinstance(s, int) and s >= 0 for s in splits):
        raise ValueError(
            f"{where}: m_splits must give {groups} token counts (non-negative ints, one per GEMM), "
            f"got {splits}"
        )
    if sum(splits) != tokens:
        raise ValueError(
            f"{where}: m_splits sum to {sum(splits)} but the input has {tokens} tokens (rows); give each "
            "group's token count, in the order of the input's rows"
        )
    return splits


def splits_from_offsets(offs: torch.Tensor, groups: int, tokens: int, where: str) -> list[int]:
    """Rows per group from `offs` in torch.nn.functional.grouped_mm's convention: a 1-D int32 tensor
    of `groups` non-decreasing end offsets, `offs[-1] <= tokens`; rows from offs[-1] on belong to no
    group. Returns the groups' row counts and, last, that of the rows after them (read on the host)."""
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        got = f"{offs.dtype} {tuple(offs.shape)}" if isinstance(offs, torch.Tensor) else type(offs).__name__
        raise ValueError(f"{where}: offs must be a 1-D int32 tensor of end offsets (grouped_mm's), got {got}")
    ends = offs.tolist()
    if len(ends) != groups:
        raise ValueError(f"{where}: offs has {len(ends)} end offsets for {groups} groups; give one per group")
    starts = [0] + ends[:-1]
    if any(e < s for s, e in zip(starts, ends)) or (ends and (ends[0] < 0 or ends[-1] > tokens)):
        raise ValueError(
            f"{where}: offs must be non-decreasing end offsets between 0 and the {tokens} rows of the input, "
            f"got {ends}"
        )
    return [e - s for s, e in zip(starts, ends)] + [tokens - (ends[-1] if ends else 0)]


def group_block(module: FP8Module) -> int:
    """The block every group's token count must fill under the region's recipe (MXFP8: 32, NVFP4: 16),
    1 where there is none (other recipes, outside FP8, a module held in high precision)."""
    settings = current_settings()
    if settings is None or not settings.enabled or SWITCHES.high_precision_now(module):
        return 1
    return settings.quantization.whole_blocks


def check_group_blocks(module: FP8Module, splits: Sequence[int], where: str) -> None:
    """Refuse group token counts off the block of the region's recipe where every GEMM dimension must be
    whole blocks (MXFP8: 32, NVFP4: 16): the tokens are the weight gradient's reduction dimension."""
    block = group_block(module)
    off = {g: n for g, n in enumerate(splits) if n % block}
    if block > 1 and off:
        name = type(current_settings().recipe).__name__
        raise ValueError(
            f"{where}: fp8train.{name} quantizes in blocks of {block} along each GEMM's reduction "
            f"dimension, so every group's token count must be a multiple of {block}; groups {off} "
            "(group: tokens) are not. "
            f"Pad each group to a multiple of {block} rows (fp8train.pad_groups, as TransformerEngine's "
            "Fp8Padding and torchao's aligned token permutation do), or train this layer with another recipe"
        )


def grouped_fp8_linear(
    module: FP8Module,
    x2d: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[Optional[torch.Tensor]],
    splits: Sequence[int],
    first_gemm: int = 0,
    is_first_microbatch: Optional[bool] = None,
) -> torch.Tensor:
    """The rows of `x2d` in consecutive groups of `splits[g]` rows, group g multiplied by `weights[g]`
    (out x in) plus `biases[g]` as GEMM `first_gemm + g` of `module`; a last entry of `splits` beyond
    the weights is rows of no group, whose output is 0. Returns the groups' outputs in row order."""
    groups = len(weights)
    rows = x2d.split(list(splits))
    batch = GroupedGEMMs(weights, splits)  # takes the groups' GEMMs where the device has grouped ones
    outs = [
        fp8_linear(module, rows[g], weights[g], biases[g], first_gemm + g, is_first_microbatch, grouped=batch)
        for g in range(groups)
    ]
    if batch.native:  # every group's operands handed over: one grouped GEMM per role
        tokens = sum(splits[:groups])
        outs = [batch.multiply(x2d[:tokens])]
    if len(rows) > groups:  # rows after the last group (grouped_mm's offs[-1] < rows): no GEMM
        out_features = weights[0].shape[0] if groups else 0
        outs.append(x2d.new_zeros(sum(len(r) for r in rows[groups:]), out_features, dtype=outs[0].dtype))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class GroupedLinear(FP8Module):
    """`num_gemms` linear layers applied to consecutive groups of rows (TransformerEngine's
    GroupedLinear): `forward(inp, m_splits)` multiplies the first m_splits[0] rows of `inp` by
    `weight0`, the next m_splits[1] by `weight1`, ...; parameters `weight{i}` (out x in) and `bias{i}`,
    each initialised as torch.nn.Linear's. FP8 inside an FP8 region under every recipe, each GEMM with
    its own delayed-scaling roles (see the module docstring).

    Args:
        num_gemms: the number of groups (experts), each its own GEMM and weight.
        in_features: the input features of every group.
        out_features: the output features of every group.
        bias: whether each group has a bias `bias{i}`.
        params_dtype: the parameters' dtype (default: torch's default dtype).
        device: where the parameters are made ("meta" for a deferred build).
        fsdp_fp8_all_gather: FSDP2 gathers the weights in FP8, each with its GEMM's scale.

    Raises:
        ValueError: `num_gemms` is not an int >= 1."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fsdp_fp8_all_gather: bool = False,
    ) -> None:
        if not isinstance(num_gemms, int) or num_gemms < 1:
            raise ValueError(f"GroupedLinear: num_gemms must be an int >= 1, got {num_gemms!r}")
        self.num_gemms = num_gemms  # before FP8Module's init: it sizes the role layout
        self.gemm_names = tuple(str(i) for i in range(num_gemms))
        super().__init__()
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.tp = TensorParallel.make(None, None, None, False, "GroupedLinear")
        for i in range(num_gemms):
            weight, b = gemm_params(
                in_features, out_features, bias, params_dtype, device, self.tp, "GroupedLinear",
                fsdp_gemm=i if fsdp_fp8_all_gather else None,
            )  # fmt: skip
            self.register_parameter(f"weight{i}", weight)
            self.register_parameter(f"bias{i}", b)

    def gemm_weights(self) -> list[torch.Tensor]:
        """The weight of each GEMM, in GEMM order (one per expert): what the module casts to FP8."""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def reset_parameters(self) -> None:
        """The initialisation of construction, again (each GEMM in turn, from the current seed)."""
        for i in range(self.num_gemms):
            reset_gemm_params(
                getattr(self, f"weight{i}"), getattr(self, f"bias{i}"), self.tp, "GroupedLinear"
            )
        self.forget_cached_weights()

    def gemm_tokens(self, inp: torch.Tensor, m_splits: Splits, *args, **kwargs) -> list[int]:
        """The rows each GEMM of a call `forward(inp, m_splits)` multiplies (coverage counts FLOPs)."""
        return splits_of(m_splits, self.num_gemms, inp.numel() // inp.shape[-1], "GroupedLinear")

    def forward(
        self, inp: torch.Tensor, m_splits: Splits, is_first_microbatch: Optional[bool] = None
    ) -> torch.Tensor:
        """The groups' outputs in the rows of their inputs.

        Args:
            inp: (..., in_features); its rows (all dimensions but the last, flattened) in consecutive
                groups.
            m_splits: the rows of each group, `num_gemms` of them summing to the rows of `inp` (0 for
                an expert that received no token: its output has no row, its history does not roll).
            is_first_microbatch: TransformerEngine's weight caching across microbatches (True: cast
                the weights and keep them; False: reuse them; None: cast every call).

        Returns:
            (..., out_features).

        Raises:
            ValueError: `inp`'s features or `m_splits` do not fit, or (MXFP8, NVFP4) a group is not
                whole blocks (pad it: `pad_groups`)."""
        if inp.shape[-1] != self.in_features:
            raise ValueError(
                f"GroupedLinear: input has {inp.shape[-1]} features, expected {self.in_features}"
            )
        x2d = inp.reshape(-1, self.in_features)
        splits = splits_of(m_splits, self.num_gemms, x2d.shape[0], "GroupedLinear")
        check_group_blocks(self, splits, "GroupedLinear")
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        y = grouped_fp8_linear(self, x2d, self.gemm_weights(), biases, splits, 0, is_first_microbatch)
        return y.view(*inp.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}"
        )


def pad_groups(x: torch.Tensor, m_splits: Sequence[int], multiple: int) -> tuple[torch.Tensor, list[int]]:
    """`x` (rows in consecutive groups of m_splits) with zero rows after each group up to a multiple of
    `multiple` rows, and the padded splits (TransformerEngine's Fp8Padding). Zero rows change no
    amax, no output row of the other rows, and no weight gradient."""
    splits = list(m_splits)
    padded = [-(-n // multiple) * multiple for n in splits]
    if padded == splits:
        return x, splits
    pieces = []
    for part, n, p in zip(x.split(splits), splits, padded):
        pieces += [part, x.new_zeros(p - n, *x.shape[1:])] if p > n else [part]
    return torch.cat(pieces), padded


def unpad_groups(y: torch.Tensor, m_splits: Sequence[int], padded_splits: Sequence[int]) -> torch.Tensor:
    """The rows of the original groups from the output of padded groups (`pad_groups`' inverse): `y`
    holds groups of `padded_splits` rows, of which the first `m_splits` rows of each are kept."""
    if list(m_splits) == list(padded_splits):
        return y
    return torch.cat([part[:n] for part, n in zip(y.split(list(padded_splits)), m_splits)])

"""FSDP2 all-gathers FP8 weights (`fsdp_fp8_all_gather=True`): docs/design.md, section 7.

With delayed scaling a weight's scale is known before its all-gather, so each rank can cast its own
shard to FP8 with it and FSDP2 gathers 1-byte values instead of 2- or 4-byte ones; the weight amax
is taken from the local shard and rides the amax reduction every other role uses (MAX over the
shards is the full weight's amax), so no collective is added.

`FSDPFP8Weight` wraps a weight's high-precision data and implements FSDP2's extension points
(`fsdp_pre_all_gather`/`fsdp_post_all_gather`); every other op runs on the wrapped data. The
gathered weight is a `GatheredWeight`: the FP8 values and their scale_inv inside an FP8 region, the
weight in its parameter dtype outside one. The FSDP2 internals relied on (torch 2.7 to 2.13) are
functions of torch_internals.py: `fsdp_param_of_caller` (the `FSDPParam` that asks for the
all-gather inputs, whose cached gather buffers must be dropped when a weight's gather precision
changes) and `dtensor_local` (the wrapper inside FSDP2's sharded DTensor).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from . import amax as protocol
from . import tensor_parallel
from .numerics.cast import amax, quantize
from .runtime import module_of
from .torch_internals import (
    dtensor_local,
    in_backward,
    reset_fsdp_gather_buffers,
    set_fsdp_unsharded_buffer,
    tree_leaves,
    tree_map_only,
)

if TYPE_CHECKING:
    from .runtime import Region

__all__ = [
    "FSDPFP8Weight",
    "GatheredWeight",
    "WeightGather",
    "plain_weight",
    "wrap_for_fsdp",
    "weight_gather",
    "is_current_gather",
    "note_gathered_forward",
    "gathered_backward_ran",
]

aten = torch.ops.aten
# ops FSDP2 shards and pads with, whose results stay FP8-gatherable (the rest return plain tensors)
_KEEP_WRAPPED = {
    aten.new_zeros.default,
    aten.empty_like.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.view.default,
    aten.as_strided.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.t.default,
}


class FSDPFP8Weight(torch.Tensor):
    """A weight's high-precision data, which FSDP2 all-gathers in FP8 inside an FP8 region."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, gemm_index: int):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device,
            requires_grad=data.requires_grad,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor, gemm_index: int) -> None:
        self._data = data
        self.gemm_index = gemm_index  # which GEMM of its module the weight feeds

    def __repr__(self) -> str:
        return f"FSDPFP8Weight({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], self.gemm_index

    @staticmethod
    def __tensor_unflatten__(inner, gemm_index, outer_size, outer_stride):
        return FSDPFP8Weight(inner["_data"], gemm_index)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrapped = [a for a in tree_leaves((args, kwargs)) if isinstance(a, FSDPFP8Weight)]
        unwrap = {id(w._data): w for w in wrapped}
        args, kwargs = tree_map_only(FSDPFP8Weight, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func in _KEEP_WRAPPED:
            return tree_map_only(torch.Tensor, lambda t: FSDPFP8Weight(t, wrapped[0].gemm_index), out)
        # an in-place op returns the data it changed: hand back its wrapper
        return tree_map_only(torch.Tensor, lambda t: unwrap.get(id(t), t), out)

    # ---- FSDP2's extension points ---------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The all-gather input: this shard cast to FP8 (as bytes: gloo cannot gather float8) with the
        weight's current scale inside an FP8 region; else the shard in the parameter dtype."""
        dtype = mp_policy.param_dtype or self.dtype
        shard = self._data.to(dtype)
        ranks = dist.get_process_group_ranks(mesh.get_group())
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 gathers shards padded to the first one's size
        if shard.dim() == 3:  # experts (E, out, in): GEMMs gemm_index + e, FSDP2 shards the experts
            return self._experts_pre_all_gather(shard, ranks, rows, module, mesh, outer_size, dtype)
        gather = weight_gather(module, self.gemm_index, ranks)
        precision = "hp" if gather.scales is None else "fp8"
        self._note_precision(precision)
        shard_amax = None
        if precision == "fp8":
            shard_amax = amax(shard)  # of what is cast: the weight role's amax, recorded in forward
            shard = quantize(shard, gather.scales[0], "e4m3").view(torch.uint8)
        if shard.shape[0] < rows:  # FP8 zero is the zero byte
            shard = torch.cat([shard, shard.new_zeros((rows - shard.shape[0], *shard.shape[1:]))])
        return (shard,), (gather, shard_amax, (self, mesh, tuple(outer_size), dtype))

    def _note_precision(self, precision: str) -> None:
        if getattr(self, "_last_precision", precision) != precision:
            # sized and typed for the other precision: FSDP2 remakes them
            reset_fsdp_gather_buffers()
        self._last_precision = precision

    def _experts_pre_all_gather(self, shard, ranks, rows, module, mesh, outer_size, dtype):
        """`fsdp_pre_all_gather` of a 3-D weight whose expert e feeds GEMM gemm_index + e (ExpertsLinear,
        FusedExperts): each expert's gather is its GEMM's (`weight_gather`), and this rank's experts
        (FSDP2 shards dim 0: experts rank * rows on) are cast each with its own GEMM's weight scale.
        The shard amax is per expert, 0 for the experts this rank does not hold (the MAX over the amax
        group, which contains the sharding group, is then each whole expert's)."""
        gathers = [weight_gather(module, self.gemm_index + e, ranks) for e in range(outer_size[0])]
        precision = "hp" if gathers[0].scales is None else "fp8"
        self._note_precision(precision)
        shard_amax = None
        if precision == "fp8":
            first = ranks.index(dist.get_rank()) * rows
            shard_amax = shard.new_zeros(outer_size[0], dtype=torch.float32)
            values = torch.empty_like(shard, dtype=torch.uint8)
            for e in range(shard.shape[0]):
                shard_amax[first + e] = amax(shard[e])
                values[e] = quantize(shard[e], gathers[first + e].scales[0], "e4m3").view(torch.uint8)
            shard = values
        if shard.shape[0] < rows:  # FP8 zero is the zero byte
            shard = torch.cat([shard, shard.new_zeros((rows - shard.shape[0], *shard.shape[1:]))])
        return (shard,), (gathers, shard_amax, (self, mesh, tuple(outer_size), dtype))

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out: Optional[GatheredWeight] = None):
        (data,) = outputs
        gather, shard_amax, context = metadata
        experts = gather if isinstance(gather, list) else None  # a 3-D weight: one gather per expert
        gather = experts[0] if experts else gather
        values = data if gather.scales is None else data.view(torch.float8_e4m3fn)
        state = _Gathered(gather, values, shard_amax, context, experts)
        if out is not None:  # later gathers refill the weight FSDP2 already handed to the module
            out._state.__dict__.update(state.__dict__)
            # its buffers may have been remade for a new precision: FSDP2 frees what it is given here
            set_fsdp_unsharded_buffer(data)
            return None
        return GatheredWeight(state, data.shape, param_dtype), (data,)


class _Gathered:
    """What a gathered weight holds; shared by every alias FSDP2 makes of it."""

    def __init__(self, gather: WeightGather, data: torch.Tensor, shard_amax, context, experts=None) -> None:
        self.gather = gather  # FP8 (with its scales and region) or the parameter dtype
        self.data = data  # FP8 values (padded rows included) or the weight in its parameter dtype
        self.shard_amax = shard_amax  # of this rank's shard, as cast (FP8 only; per expert for experts)
        self.shard, self.mesh, self.size, self.dtype = context
        self.experts = experts  # a 3-D weight's gather per expert (its GEMMs'), else None


class GatheredWeight(torch.Tensor):
    """A weight FSDP2 gathered from `FSDPFP8Weight` shards: FP8 values and their scale_inv, for the FP8
    module that owns it; or, gathered outside an FP8 region, the weight itself (every op sees it)."""

    @staticmethod
    def __new__(cls, state: _Gathered, shape, dtype, transposed: bool = False, expert: Optional[int] = None):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=state.data.device)

    def __init__(
        self, state: _Gathered, shape, dtype, transposed: bool = False, expert: Optional[int] = None
    ) -> None:
        self._state = state
        self.transposed = transposed  # a (in, out) weight used as weight.t(): transformers' Conv1D
        self.expert = expert  # one expert (dim-0 slice, `unbind`) of a gathered 3-D weight, or None

    @property
    def fp8(self) -> bool:
        return self._state.gather.scales is not None

    @property
    def gather(self) -> WeightGather:
        return self._state.gather if self.expert is None else self._state.experts[self.expert]

    def fp8_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 weight (unpadded) and its scale_inv."""
        state = self._state
        return self._oriented(state.data[: state.size[0]]), self.gather.scales[1]

    def shard_amax(self) -> torch.Tensor:
        """The amax of this rank's shard of the weight as it was cast (in the parameter dtype): the
        MAX over the amax group, which contains the sharding group, is the whole weight's."""
        amaxes = self._state.shard_amax
        return amaxes if self.expert is None else amaxes[self.expert]

    def high_precision(self) -> torch.Tensor:
        """The weight in its parameter dtype: itself, or gathered again from the shards (all ranks)."""
        state = self._state
        if not self.fp8:
            return self._oriented(state.data[: state.size[0]])
        shard = state.shard._data.to(state.dtype)
        world = state.mesh.size()
        rows = -(-state.size[0] // world)
        padded = torch.cat([shard, shard.new_zeros((rows - shard.shape[0], *shard.shape[1:]))])
        full = padded.new_empty((rows * world, *padded.shape[1:]))
        tensor_parallel._all_gather(full, padded.contiguous(), state.mesh.get_group())
        return self._oriented(full[: state.size[0]])

    def _oriented(self, weight: torch.Tensor) -> torch.Tensor:
        weight = weight if self.expert is None else weight[self.expert]
        return weight.t() if self.transposed else weight

    def __repr__(self) -> str:
        return f"GatheredWeight({'fp8' if self.fp8 else 'hp'}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, GatheredWeight))
        if func in (aten.detach.default, aten.alias.default):  # FSDP2's and autograd's aliases
            return GatheredWeight(first._state, first.shape, first.dtype, first.transposed, first.expert)
        if func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) in (
            tuple(first.shape),
            first._state.size,
        ):  # and its view of the padded rows as the parameter's shape
            return GatheredWeight(
                first._state, torch.Size(args[1]), first.dtype, first.transposed, first.expert
            )
        dim = (
            (args[1] if len(args) > 1 else (kwargs or {}).get("dim", 0)) if func is aten.unbind.int else None
        )
        if dim in (0, -3) and first.fp8 and first._state.experts is not None and first.expert is None:
            # a 3-D weight gathered in FP8: its experts, each for its own GEMM (grouped_linear)
            experts = range(first.shape[0])
            return tuple(
                GatheredWeight(first._state, first.shape[1:], first.dtype, False, e) for e in experts
            )
        if func is aten.t.default or (func is aten.transpose.int and {d % 2 for d in args[1:3]} == {0, 1}):
            return GatheredWeight(first._state, first.shape[::-1], first.dtype, not first.transposed)
        if first.fp8:
            raise RuntimeError(
                f"{func} on a weight that FSDP2 holds gathered in FP8 (fsdp_fp8_all_gather): only its FP8 "
                "module can use it. Read weights where FSDP2 has resharded them (after backward, or after "
                "calling reshard() on the FSDP module; not inside an FP8 forward, and not between an FP8 "
                "forward and its backward when reshard_after_forward=False)"
            )
        args, kwargs = tree_map_only(GatheredWeight, lambda w: w.high_precision(), (args, kwargs or {}))
        return func(*args, **kwargs)


def wrap_for_fsdp(parameter: torch.nn.Parameter, gemm_index: int) -> None:
    """Make `parameter` hold its data in an `FSDPFP8Weight`, in place: the same Parameter object (an
    optimizer built before keeps it), the same values."""
    if not isinstance(parameter, FSDPFP8Weight):
        wrapped = torch.nn.Parameter(FSDPFP8Weight(parameter.data, gemm_index), parameter.requires_grad)
        torch.utils.swap_tensors(parameter, wrapped)


def plain_weight(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a weight, or FSDP2's DTensor of one) with an `FSDPFP8Weight` replaced by the data it
    wraps, sharing storage: what checkpoints save and load into, so that a checkpoint does not depend
    on the option and loading in place still writes the weight."""
    local = dtensor_local(tensor)
    if not isinstance(local, FSDPFP8Weight):
        return tensor
    if local is tensor:
        return local._data
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local._data, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
        stride=tensor.stride(),
    )  # fmt: skip


# ---- which gathers a weight's forward and backward need (delayed scaling's FP8 gathers) --------------
@dataclass(frozen=True)
class WeightGather:
    """How FSDP2 gathers a module's weight for a forward (fsdp.py)."""

    scales: Optional[tuple[torch.Tensor, torch.Tensor]]  # (scale, scale_inv) in FP8; None: parameter dtype
    region: Optional[Region]  # the FP8 region it was gathered for


class GatherBook:
    """A weight's latest gather, and the training forwards that saved its FP8 values for backward
    (their autograd nodes, weakly: a dropped graph owes nothing) until their backward runs."""

    def __init__(self) -> None:
        self.latest = WeightGather(None, None)
        self.owed: list[tuple[weakref.ref, WeightGather]] = []

    def pending(self) -> list[WeightGather]:
        self.owed = [(node, gather) for node, gather in self.owed if node() is not None]
        return [gather for _, gather in self.owed]


def _gather_book(module, gemm_index: int) -> GatherBook:
    return module.fsdp_gathers.setdefault(gemm_index, GatherBook())


def weight_gather(module, gemm_index: int, shard_ranks: list[int]) -> WeightGather:
    """How FSDP2 gathers `module`'s weight of GEMM `gemm_index` now: in FP8 with the weight role's
    scale of the current region (the one its forward will cast with), or in the parameter dtype
    outside an FP8 region of delayed scaling. A backward re-gather reproduces the gather whose FP8
    values a forward saved, and records nothing."""
    if not hasattr(module, "fp8_meta"):  # FSDP2 gathers a tied weight for the module that holds it
        return _tied_weight_gather(module)
    book = _gather_book(module, gemm_index)
    pending = book.pending()
    if in_backward():
        return pending[-1] if pending else book.latest
    now = protocol.fp8_gathers()
    region = now.region
    if any(gather.region is not region for gather in pending):
        raise RuntimeError(
            f"{module.signature} (fsdp_fp8_all_gather) ran forward in another FP8 region or precision "
            "before the backward of its previous training forward: FSDP2's backward re-gather could not "
            "reproduce the FP8 weight that forward used. Run that backward first (schedules with several "
            "microbatches in flight are not supported with the option), or build the module without it"
        )
    # the scales the forward will cast with; refused where the amax group does not contain shard_ranks
    scales = None if region is None else now.weight_scales(module, gemm_index, shard_ranks)
    book.latest = WeightGather(scales, region)
    return book.latest


def _tied_weight_gather(module) -> WeightGather:
    """A weight shared with a module that is not an FP8 module: gathered as is outside FP8 regions,
    refused inside (only its FP8 module may use a weight gathered in FP8)."""
    if protocol.fp8_gathers().region is not None:
        raise RuntimeError(
            f"fsdp_fp8_all_gather: FSDP2 gathers a weight for {type(module).__name__}, which shares it "
            "with an FP8 module (tied weights, e.g. an embedding and the output head). A weight gathered "
            "in FP8 is for its FP8 module only. Build that FP8 module without fsdp_fp8_all_gather (e.g. "
            "leave the head out of convert_to_fp8 with its filter), or untie the weights"
        )
    return WeightGather(None, None)


def is_current_gather(gather: WeightGather) -> bool:
    """Whether a weight gathered in FP8 for `gather` may serve this call: gathered for this region,
    or a recomputation in backward (whose re-gather reproduced the original forward's)."""
    return protocol.fp8_gathers().serves(gather.region)


def note_gathered_forward(module, gemm_index: int, gather: WeightGather, output: torch.Tensor) -> None:
    """A training forward saved the FP8 weight gathered for `gather`: its backward re-gather must match."""
    if output.grad_fn is not None:
        _gather_book(module, gemm_index).owed.append((weakref.ref(output.grad_fn), gather))


def gathered_backward_ran(handle: torch.Tensor, gemm_index: int, node) -> None:
    """The backward of the forward whose autograd node is `node` ran: it owes nothing any more."""
    book = module_of(handle).fsdp_gathers.get(gemm_index)
    if book is not None:
        book.owed = [(ref, gather) for ref, gather in book.owed if ref() is not node]

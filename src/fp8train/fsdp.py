"""FSDP2 all-gathers FP8 weights (`fsdp_fp8_all_gather=True`): docs/design.md, section 7.

With delayed scaling a weight's scale is known before its all-gather, so each rank can cast its own
shard to FP8 with it and FSDP2 gathers 1-byte values instead of 2- or 4-byte ones; the weight amax
is taken from the local shard and rides the amax reduction every other role uses (MAX over the
shards is the full weight's amax), so no collective is added.

`FSDPFP8Weight` wraps a weight's high-precision data and implements FSDP2's extension points
(`fsdp_pre_all_gather`/`fsdp_post_all_gather`); every other op runs on the wrapped data. The
gathered weight is a `GatheredWeight`: the FP8 values and their scale_inv inside an FP8 region, the
weight in its parameter dtype outside one. FSDP2 internals relied on (torch 2.4 to 2.13), all in
`_fsdp_param_of_caller`: the `FSDPParam` that asks for the all-gather inputs, whose cached gather
buffers must be dropped when a weight's gather precision changes.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from . import protocol
from .cast import amax, quantize

__all__ = ["FSDPFP8Weight", "GatheredWeight", "plain_weight", "wrap_for_fsdp"]

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
        wrapped = [a for a in _flat((args, kwargs)) if isinstance(a, FSDPFP8Weight)]
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
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 gathers shards padded to the first one's size
        if shard.shape[0] < rows:
            shard = torch.cat([shard, shard.new_zeros((rows - shard.shape[0], *shard.shape[1:]))])
        scales = protocol.weight_gather_scales(module, self.gemm_index)
        fsdp_param = _fsdp_param_of_caller()
        precision = "hp" if scales is None else "fp8"
        if getattr(self, "_last_precision", precision) != precision and fsdp_param is not None:
            fsdp_param.all_gather_outputs = []  # sized and typed for the other precision: FSDP2 remakes them
        self._last_precision = precision
        context = (self, mesh, tuple(outer_size), dtype)
        if scales is None:
            return (shard,), ("hp", None, context)
        scale, scale_inv = scales
        return (quantize(shard, scale, "e4m3").view(torch.uint8),), ("fp8", scale_inv, context)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out: Optional[GatheredWeight] = None):
        (data,) = outputs
        precision, scale_inv, context = metadata
        values = data.view(torch.float8_e4m3fn) if precision == "fp8" else data
        state = _Gathered(precision, values, scale_inv, context)
        if out is not None:  # later gathers refill the weight FSDP2 already handed to the module
            out._state.__dict__.update(state.__dict__)
            fsdp_param = _fsdp_param_of_caller()
            if fsdp_param is not None:  # buffers remade for a new precision: FSDP2 frees these
                fsdp_param._unsharded_inner_tensors = [data]
            return None
        return GatheredWeight(state, data.shape, param_dtype), (data,)


def _flat(tree) -> list:
    return torch.utils._pytree.tree_leaves(tree)


class _Gathered:
    """What a gathered weight holds; shared by every alias FSDP2 makes of it."""

    def __init__(self, precision: str, data: torch.Tensor, scale_inv, context) -> None:
        self.precision = precision  # "fp8" or "hp"
        self.data = data  # FP8 values (padded rows included) or the weight in its parameter dtype
        self.scale_inv = scale_inv
        self.shard, self.mesh, self.size, self.dtype = context


class GatheredWeight(torch.Tensor):
    """A weight FSDP2 gathered from `FSDPFP8Weight` shards: FP8 values and their scale_inv, for the FP8
    module that owns it; or, gathered outside an FP8 region, the weight itself (every op sees it)."""

    @staticmethod
    def __new__(cls, state: _Gathered, shape, dtype, transposed: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=state.data.device)

    def __init__(self, state: _Gathered, shape, dtype, transposed: bool = False) -> None:
        self._state = state
        self.transposed = transposed  # a (in, out) weight used as weight.t(): transformers' Conv1D

    @property
    def fp8(self) -> bool:
        return self._state.precision == "fp8"

    def fp8_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 weight (unpadded) and its scale_inv."""
        state = self._state
        return self._oriented(state.data[: state.size[0]]), state.scale_inv

    def shard_amax(self) -> torch.Tensor:
        """The amax of this rank's shard of the weight, in the parameter dtype's rounding (rounding
        is monotonic: the amax of the rounded shard is the rounded amax)."""
        state = self._state
        return amax(state.shard._data).to(state.dtype).float()

    def high_precision(self) -> torch.Tensor:
        """The weight in its parameter dtype: itself, or gathered again from the shards (all ranks)."""
        state = self._state
        if state.precision == "hp":
            return self._oriented(state.data[: state.size[0]])
        shard = state.shard._data.to(state.dtype)
        world = state.mesh.size()
        rows = -(-state.size[0] // world)
        padded = torch.cat([shard, shard.new_zeros((rows - shard.shape[0], *shard.shape[1:]))])
        full = padded.new_empty((rows * world, *padded.shape[1:]))
        dist.all_gather_into_tensor(full, padded.contiguous(), group=state.mesh.get_group())
        return self._oriented(full[: state.size[0]])

    def _oriented(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t() if self.transposed else weight

    def __repr__(self) -> str:
        return f"GatheredWeight({self._state.precision}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(a for a in _flat((args, kwargs)) if isinstance(a, GatheredWeight))
        if func in (aten.detach.default, aten.alias.default):  # FSDP2's and autograd's aliases
            return GatheredWeight(first._state, first.shape, first.dtype, first.transposed)
        if func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) in (
            tuple(first.shape),
            first._state.size,
        ):  # and its view of the padded rows as the parameter's shape
            return GatheredWeight(first._state, torch.Size(args[1]), first.dtype, first.transposed)
        if func is aten.t.default or (func is aten.transpose.int and {d % 2 for d in args[1:3]} == {0, 1}):
            return GatheredWeight(first._state, first.shape[::-1], first.dtype, not first.transposed)
        if first.fp8:
            raise RuntimeError(
                f"{func} on a weight that FSDP2 gathered in FP8: only its FP8 module uses it (inside the FP8 "
                "region it was gathered in). Use the module, or run this outside the FP8 region"
            )
        args, kwargs = tree_map_only(GatheredWeight, lambda w: w.high_precision(), (args, kwargs or {}))
        return func(*args, **kwargs)


def _fsdp_param_of_caller() -> Any:
    """The FSDP2 `FSDPParam` whose `all_gather_inputs` called `fsdp_pre_all_gather` (FSDP2 internals)."""
    frame = sys._getframe(2)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if type(candidate).__name__ == "FSDPParam" and hasattr(candidate, "all_gather_outputs"):
            return candidate
        frame = frame.f_back
    return None


def wrap_for_fsdp(parameter: torch.nn.Parameter, gemm_index: int) -> None:
    """Make `parameter` hold its data in an `FSDPFP8Weight`, in place: the same Parameter object (an
    optimizer built before keeps it), the same values."""
    if torch.__version__ < "2.6":
        raise RuntimeError(
            "fsdp_fp8_all_gather needs torch >= 2.6 (FSDP2's fsdp_pre_all_gather with the module and mixed "
            f"precision policy); this is torch {torch.__version__}: upgrade torch or drop the option"
        )
    if not isinstance(parameter, FSDPFP8Weight):
        wrapped = torch.nn.Parameter(FSDPFP8Weight(parameter.data, gemm_index), parameter.requires_grad)
        torch.utils.swap_tensors(parameter, wrapped)


def plain_weight(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a weight, or FSDP2's DTensor of one) with an `FSDPFP8Weight` replaced by the data it
    wraps, sharing storage: what checkpoints save and load into, so that a checkpoint does not depend
    on the option and loading in place still writes the weight."""
    local = getattr(tensor, "_local_tensor", tensor)
    if not isinstance(local, FSDPFP8Weight):
        return tensor
    if local is tensor:
        return local._data
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local._data, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
        stride=tensor.stride(),
    )  # fmt: skip

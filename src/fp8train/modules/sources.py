"""Where an FP8 GEMM's operands come from: the weight source and the input source each module call
picks once, which the recipe's quantization turns into operands (docs/design.md, section 9.3).

`fp8_linear` picks a weight source (`weight_source`: the weight cast at this call, the step's first
microbatch's FP8 weight, the same weight cast again with the scale it was first cast with after a
load, a stored FP8 weight, FSDP2's gather of FP8 shards, or the weight of a high-precision call)
and an input source (`LOCAL`, or the sequence-parallel tokens of `input_source`), and then runs one
path for all of them: the call's scales with the source's weight amax, the operands each source
asks the recipe for, the GEMM. A source is a small object that says what it is by its attributes
and makes its operands with one method; no function branches on which source it has.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ..fsdp import GatheredWeight, WeightGather, is_current_gather
from ..numerics.cast import amax
from ..numerics.operand import Operand
from ..quantization.base import AMAX_IN_CAST, InputOperands, Quantization, WeightOperands
from ..runtime import Call
from ..tensor_parallel import TokenCollective, gather_fp8_tokens

__all__ = [
    "WeightSource",
    "CachedWeight",
    "HighPrecisionWeight",
    "weight_source",
    "InputSource",
    "LOCAL",
    "input_source",
]


# ---- the weight ---------------------------------------------------------------------------------------
class WeightSource:
    """Where the weight's operands of an FP8 GEMM call come from (this base: the weight, cast by the
    recipe at this call, eagerly: the cast takes its amax).

    - `weight_amax`: what `Quantization.call_scales` records as the weight's amax: AMAX_IN_CAST (the
      cast takes it), a function that gives it, or None (the weight is not cast here: nothing);
    - `cast_scales`: [scale, scale_inv] to cast the weight with instead of the region's, or None;
    - `kept`: its operands are kept for the step's next microbatches (`is_first_microbatch` given,
      nothing kept yet), with the [scale, scale_inv] they were cast with;
    - `gather`: FSDP2's FP8 gather whose values this forward uses (its backward re-gather must
      reproduce it: `fsdp.note_gathered_forward`; a kept copy of its values is taken, since FSDP2
      refills their buffer), or None.
    """

    fp8 = True  # the call runs in FP8 (HighPrecisionWeight: it does not)
    weight_amax: Any = AMAX_IN_CAST
    cast_scales: Optional[torch.Tensor] = None
    kept = False
    gather: Optional[WeightGather] = None

    def __init__(self, kept: bool = False) -> None:
        self.kept = kept

    def operands(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        """The weight's operands for `call` (made by its recipe, `call.quantization`)."""
        return call.quantization.quantize_weight(weight.detach(), call)


CAST, KEPT_CAST = WeightSource(), WeightSource(kept=True)  # the weight cast at this call, eagerly


class CompiledCast(WeightSource):
    """The weight cast at this call in a compiled graph: its amax goes into the protocol's op first
    (inductor fuses the two reads)."""

    def __init__(self, weight: torch.Tensor, kept: bool) -> None:
        self.weight_amax, self.kept = (lambda: amax(weight)), kept


class CachedWeight(WeightSource):
    """The operands the step's first microbatch kept (`is_first_microbatch=False`): not cast again.
    The module's weight cache holds these sources (`FP8Module.cache_weight`)."""

    weight_amax = None

    def __init__(self, cached: WeightOperands, gather: Optional[WeightGather]) -> None:
        self.cached, self.gather = cached, gather

    def operands(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        return call.quantization.reuse_weight(self.cached, call)


class RebuiltWeight(WeightSource):
    """The step's first microbatch's FP8 weight after a load dropped it: the weight cast again with
    the scale it was cast with then (saved with the module's state), recording no amax; kept again."""

    weight_amax = None
    kept = True

    def __init__(self, cast_scales: torch.Tensor) -> None:
        self.cast_scales = cast_scales


class GatheredFP8Weight(WeightSource):
    """A weight FSDP2 gathered in FP8 for this call (delayed scaling): each rank cast its shard with
    this region's weight scale before the gather, so the recipe takes the FP8 values as they are; the
    weight's amax is its local shard's (the amax reduction makes it the whole weight's)."""

    def __init__(self, weight: GatheredWeight, kept: bool) -> None:
        self.weight_amax, self.gather, self.kept = weight.shard_amax, weight.gather, kept

    def operands(self, weight: GatheredWeight, call: Call) -> WeightOperands:
        values, scale_inv = weight.fp8_values()
        return call.quantization.reuse_weight(WeightOperands.same(Operand(values, scale_inv)), call)


class StoredWeight(WeightSource):
    """A weight stored in FP8 (StoredFP8Linear): its operands used as they are, whatever the recipe
    (a block operand: `gemm.matmul` dequantizes it); never cast, kept or recorded."""

    weight_amax = None

    def __init__(self, stored: WeightOperands) -> None:
        self.stored = stored

    def operands(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        return self.stored


class HighPrecisionWeight:
    """The weight of a call that runs in high precision (outside FP8, or an empty GEMM): multiplied as
    it is; a calibrating call records its amax."""

    fp8 = False

    def linear_weight(self, weight: torch.Tensor, x: torch.Tensor, call: Call) -> torch.Tensor:
        """What `torch.nn.functional.linear` multiplies `x` with."""
        if call.record and weight.numel():  # calibrating: amaxes only
            call.quantization.call_scales(call, x, lambda: amax(weight))
        return weight


HIGH_PRECISION = HighPrecisionWeight()


class DequantizedStoredWeight(HighPrecisionWeight):
    """A stored FP8 weight in a call that runs in high precision: dequantized, in the input's dtype."""

    def __init__(self, stored: WeightOperands) -> None:
        self.stored = stored

    def linear_weight(self, weight: torch.Tensor, x: torch.Tensor, call: Call) -> torch.Tensor:
        return self.stored.forward.dequantize().to(x.dtype)


class _HighPrecision(torch.autograd.Function):
    """A weight FSDP2 gathered in FP8, gathered again in its parameter dtype; gradients pass through."""

    @staticmethod
    def forward(ctx, weight: GatheredWeight) -> torch.Tensor:
        return weight.high_precision()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def weight_source(
    module,
    weight: torch.Tensor,
    call: Call,
    gemm_index: int,
    is_first_microbatch: Optional[bool],
    stored: Optional[WeightOperands],
) -> tuple[torch.Tensor, Union[WeightSource, HighPrecisionWeight]]:
    """The weight `call` multiplies and where its operands come from, picked once per call (the
    table of docs/design.md, section 9.3). `stored`: a StoredFP8Linear's operands."""
    gathered = False
    if isinstance(weight, GatheredWeight):  # an FSDP2 gather of an fsdp_fp8_all_gather weight
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "torch.compile over FP8 modules built with fsdp_fp8_all_gather is not supported: the "
                "gathered FP8 weight's bookkeeping runs outside the graph. Compile without the option, "
                "or run eagerly"
            )
        gathered = weight.fp8  # FSDP2 gathered it in FP8 already
    if gathered and not (
        call.fp8 and call.quantization.casts_before_gather and is_current_gather(weight.gather)
    ):
        # gathered in FP8 for another region (FSDP2 kept it gathered), or needed in high precision
        weight, gathered = _HighPrecision.apply(weight), False  # gathered again, in the parameter dtype
    if not call.fp8 or 0 in weight.shape:  # an empty GEMM (Linear(0, n)): the bias, as torch gives
        return weight, HIGH_PRECISION if stored is None else DequantizedStoredWeight(stored)
    if stored is not None:
        return weight, StoredWeight(stored)
    if is_first_microbatch is False:  # the step's weight, kept by its first microbatch
        cached = module.cached_weight(gemm_index, call.quantization.kind)
        if cached is not None:  # (a new source only to note an FSDP2 gather: see `gather`)
            return weight, CachedWeight(cached.cached, weight.gather) if gathered else cached
        rebuild = module.weight_cast_scales(gemm_index, call.quantization.kind)
        if rebuild is not None:  # dropped by a load: cast again with the scale it was cast with
            if gathered:
                raise RuntimeError(
                    f"{module.signature}: is_first_microbatch=False after a load, with fsdp_fp8_all_gather: "
                    "the FP8 weight of the step's first microbatch cannot be rebuilt from the gathered "
                    "shards. Resume the step with is_first_microbatch=True, or save at a step boundary"
                )
            return weight, RebuiltWeight(rebuild)
    kept = is_first_microbatch is not None  # nothing kept yet: kept for the next microbatches
    if gathered:  # cast on the shard before the gather, with this region's weight scale
        return weight, GatheredFP8Weight(weight, kept)
    if torch.compiler.is_compiling():
        return weight, CompiledCast(weight, kept)
    return weight, KEPT_CAST if kept else CAST  # eager: the cast may take the weight's amax in its read


# ---- the input ----------------------------------------------------------------------------------------
class InputSource:
    """Where the input's operands of an FP8 GEMM call come from (this base, `LOCAL`: the tokens the
    call is given, quantized by the recipe).

    - `fp8_group`: the group whose tokens are gathered in FP8 after their cast (sequence
      parallelism with a recipe that casts before the gather; backward reduce-scatters the input's
      gradient over it), or None;
    - `ranks`: how many ranks' tokens the GEMM multiplies.
    """

    fp8_group = None
    ranks = 1

    def operands(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        """The input's operands for `call` (made by its recipe, `call.quantization`)."""
        return call.quantization.quantize_input(x2d, call)


LOCAL = InputSource()


class TokensGatheredInFP8(InputSource):
    """Sequence parallelism: this rank's tokens cast with the (delayed) scale known before the
    gather, then gathered from every rank of the group as FP8 values."""

    def __init__(self, group) -> None:
        self.fp8_group, self.ranks = group, dist.get_world_size(group)

    def operands(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        local = call.quantization.quantize_input(x2d, call).forward
        gathered = Operand(gather_fp8_tokens(local.values, self.fp8_group), local.scale_inv)
        return InputOperands(gathered, gathered)


def input_source(x: torch.Tensor, sp_group, quantization: Quantization) -> tuple[torch.Tensor, InputSource]:
    """The tokens of a sequence-parallel FP8 call (`sp_group`: the TP group, x this rank's tokens)
    and their source: cast here and gathered in FP8 where the recipe's scale is known before the
    gather, else gathered in high precision first and cast where the tensor is whole."""
    if quantization.casts_before_gather:
        return x, TokensGatheredInFP8(sp_group)
    return TokenCollective.apply(x, sp_group, True), LOCAL

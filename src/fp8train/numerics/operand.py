"""A quantized GEMM operand: what every recipe makes and every GEMM path (gemm.py, block_scaled_mm.py)
multiplies."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["Operand"]


class Operand:
    """A GEMM operand quantized to a low-precision format: its values (an FP8 dtype, or bf16/fp32
    holding FP8 values exactly) and the inverse scale that dequantizes them, one for the whole tensor
    (`block` None) or one per `block` = (rows, columns) of the values as stored; a two-level format
    (NVFP4) also divides the whole tensor by `tensor_scale`. `transposed` operands are used as the
    transpose of what is stored (a view: nothing is copied or requantized); a per-tensor recipe's
    operand for the GEMM that takes its tensor in the other layout (w in dgrad, x and g in wgrad) is
    so where a fused kernel wrote the tensor's transposed copy (quantization/per_tensor.py,
    `cast_operands`): the layout torch._scaled_mm takes there. `rotated` operands hold a
    tensor after a random Hadamard transform along their reduction dimension: only a product with
    another operand rotated alike is the product of the original tensors.

    A value: never changed after it is made (`t` makes another). A plain class with slots, not a
    frozen dataclass, whose constructor sets each field through `object.__setattr__`: three to six
    are made per FP8 linear call, 0.5 us each where the dataclass took 1.6 (the lean path,
    docs/design.md, section 6)."""

    __slots__ = ("values", "scale_inv", "block", "transposed", "tensor_scale", "rotated")

    def __init__(
        self,
        values: torch.Tensor,
        scale_inv: torch.Tensor,
        block: Optional[tuple[int, int]] = None,
        transposed: bool = False,
        tensor_scale: Optional[torch.Tensor] = None,
        rotated: bool = False,
    ) -> None:
        self.values, self.scale_inv, self.block = values, scale_inv, block
        self.transposed, self.tensor_scale, self.rotated = transposed, tensor_scale, rotated

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"Operand({fields})"

    def t(self) -> Operand:
        return Operand(
            self.values, self.scale_inv, self.block, not self.transposed, self.tensor_scale, self.rotated
        )

    def oriented(self) -> torch.Tensor:
        return self.values.t() if self.transposed else self.values

    def dequantize(self) -> torch.Tensor:
        """The values times their scale_inv (divided by the tensor scale), in fp32: exact where the
        scales are powers of 2, one correctly rounded division for a two-level format."""
        values = self.values.float()
        if self.block is None:
            values = values * self.scale_inv
        else:
            rows, cols = self.block
            r, c = values.shape
            values = values * self.scale_inv.repeat_interleave(rows, 0)[:r].repeat_interleave(cols, 1)[:, :c]
        if self.tensor_scale is not None:
            values = values / self.tensor_scale
        return values.t() if self.transposed else values

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        return self.values, self.scale_inv, self.tensor_scale

    @property
    def layout(self) -> tuple:
        """What makes the operand again with its `tensors()` (`Operand.rebuild`)."""
        return self.block, self.transposed, self.rotated

    @staticmethod
    def rebuild(tensors: tuple, layout: tuple) -> Operand:
        values, scale_inv, tensor_scale = tensors
        block, transposed, rotated = layout
        return Operand(values, scale_inv, block, transposed, tensor_scale, rotated)

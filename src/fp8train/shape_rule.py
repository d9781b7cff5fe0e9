"""One rule for the weight shapes FP8 GEMMs take, the same on every device (docs/design.md, section 10).

torch._scaled_mm (cuBLASLt) needs both dimensions of the weight to be multiples of 16, as
TransformerEngine asserts before an FP8 GEMM and torchao's conversion requires. fp8train's rule for a
weight off that multiple, wherever it runs (the CPU, a GPU, whatever `FP8TRAIN_GEMM` says):

- `convert_to_fp8` and `prepare` (fp8train's choice) leave such a layer a `torch.nn.Linear`: high
  precision, as TransformerEngine and torchao would; coverage reports it "shape", and one warning
  names it unless a module_filter_fn asked for it;
- an FP8 module built with such a shape (your choice: `fp8train.Linear(60, 50)`) computes it in FP8
  through the exact emulation on every device: the same FP8 numerics as the CPU's default path, bit
  for bit, never torch._scaled_mm (which would refuse it, as TransformerEngine does). Where the device
  would run the kernel for other shapes (a GPU, `FP8TRAIN_GEMM=scaled_mm`) that is a fallback, slower
  than the kernel, and the module warns once (modules/fp8_linear.py); coverage reports it in FP8 with
  the emulated path ("bf16"), the step counters count it in FP8.

So what coverage reports is what runs. The token count (the input's rows) changes from call to call
and is not part of the rule: a count off 16 takes the same exact emulation where torch._scaled_mm
cannot take it (gemm.choose_path).
"""

from __future__ import annotations

__all__ = ["GEMM_MULTIPLE", "weight_fits", "why_off"]

GEMM_MULTIPLE = 16


def weight_fits(out_features: int, in_features: int) -> bool:
    """Whether torch._scaled_mm takes a weight of `out_features` x `in_features` (both multiples of 16;
    an empty weight fits: it multiplies nothing)."""
    return out_features % GEMM_MULTIPLE == 0 and in_features % GEMM_MULTIPLE == 0


def why_off(out_features: int, in_features: int) -> str:
    """Why torch._scaled_mm cannot take a weight of this shape, and the nearest shape it takes."""

    def up(n: int) -> int:
        return -(-n // GEMM_MULTIPLE) * GEMM_MULTIPLE

    return (
        f"its weight is {out_features}x{in_features} (out x in), and torch._scaled_mm needs both dimensions "
        f"to be multiples of {GEMM_MULTIPLE} (padded: {up(out_features)}x{up(in_features)})"
    )

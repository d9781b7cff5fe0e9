"""One rule for the weight shapes FP8 GEMMs take, the same on every device (docs/design.md, section 10).

An FP8 GEMM needs both dimensions of its weight to be multiples of 16: what torch._scaled_mm
(cuBLASLt) takes, what TransformerEngine asserts before an FP8 GEMM, and what torchao's conversion
requires. A GEMM whose weight is off that multiple runs in high precision wherever it runs (the CPU,
a GPU, whatever `FP8TRAIN_GEMM` says):

- `convert_to_fp8` and `prepare` leave such a layer a `torch.nn.Linear` (coverage: "shape");
- an FP8 module built with such a shape (`fp8train.Linear(60, 50)`) computes that GEMM in its
  parameters' dtype inside an FP8 region, records no amax, and warns once (modules/fp8_linear.py);
  `fp8train.coverage` reports it "shape", the step counters count it in high precision.

So what coverage reports is what runs. The token count (the input's rows) changes from call to call
and is not part of the rule: a count off 16 keeps FP8 numerics and takes the exact emulation where
torch._scaled_mm cannot take it (gemm.choose_path).
"""

from __future__ import annotations

__all__ = ["GEMM_MULTIPLE", "weight_fits", "why_off"]

GEMM_MULTIPLE = 16


def weight_fits(out_features: int, in_features: int) -> bool:
    """Whether an FP8 GEMM takes a weight of `out_features` x `in_features` (both multiples of 16;
    an empty weight fits: it multiplies nothing)."""
    return out_features % GEMM_MULTIPLE == 0 and in_features % GEMM_MULTIPLE == 0


def why_off(out_features: int, in_features: int) -> str:
    """Why a weight of this shape runs in high precision, and the nearest shape that would not."""

    def up(n: int) -> int:
        return -(-n // GEMM_MULTIPLE) * GEMM_MULTIPLE

    return (
        f"its weight is {out_features}x{in_features} (out x in) and FP8 GEMMs need both dimensions to be "
        f"multiples of {GEMM_MULTIPLE} on every device (padded: {up(out_features)}x{up(in_features)})"
    )

"""Every float32 bit pattern of one sign with |x| <= 2 * fp8_max, cast by fp8train's float32 rounding
(`cast_operand` to float32, scale 1) and by torch's FP8 conversion: prints the mismatches (expected 0).

    python scripts/check_cast_exhaustively.py [--sign negative|positive] [--encodings e4m3,e5m2]

About 10 minutes per encoding and sign on one loaded core. Larger magnitudes saturate before rounding.
"""

from __future__ import annotations

import argparse
import time

import torch

from fp8train.numerics.cast import cast_operand
from fp8train.numerics.formats import fp8_dtype, fp8_max


def mismatches(encoding: str, negative: bool, chunk: int = 1 << 24) -> tuple[int, int]:
    limit = fp8_max(encoding)
    top = int(torch.tensor(2 * limit).view(torch.int32))
    sign = -(2**31) if negative else 0
    bad = 0
    for low in range(0, top + 1, chunk):
        bits = torch.arange(low, min(low + chunk, top + 1), dtype=torch.int64).to(torch.int32) | sign
        x = bits.view(torch.float32)
        got = cast_operand(x, torch.tensor(1.0), encoding, torch.float32)
        want = x.clamp(-limit, limit).to(fp8_dtype(encoding)).float()
        bad += int((got.view(torch.int32) != want.view(torch.int32)).sum())
    return top + 1, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sign", choices=("negative", "positive"), default="negative")
    parser.add_argument("--encodings", default="e4m3,e5m2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    failed = False
    for encoding in args.encodings.split(","):
        start = time.time()
        checked, bad = mismatches(encoding, args.sign == "negative")
        print(f"{encoding} {args.sign}: {checked} patterns, {bad} mismatches ({time.time() - start:.0f} s)")
        failed |= bad > 0
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())

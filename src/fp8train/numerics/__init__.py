"""The numerics: FP8 formats, casts, microscaled (MX, NVFP4) encodings, GEMM operands and the GEMMs
(emulated, torch._scaled_mm, its block-scaled kernels), the fused Triton kernels: pure functions of
tensors, with no state of a step, no amax protocol, no recipe object and no module (docs/design.md, section
10.3, "File layout").

Nothing is imported here: each module is imported by its path (`fp8train.numerics.cast`), so that
`recipe.py` can import `formats` without the rest, and `kernels` keeps Triton unimported until it runs.
"""

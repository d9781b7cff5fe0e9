"""The numerics: FP8 formats, casts, microscaled (MX, NVFP4) encodings, GEMM operands and the GEMMs, the
fused Triton kernels, and block-FP8 checkpoint weights: pure functions of tensors, with no state of a
step, no amax protocol and no module (docs/design.md, section 10, "File layout").

Nothing is imported here: each module is imported by its path (`fp8train.numerics.cast`), so that
`recipe.py` can import `formats` without the rest, and `kernels` keeps Triton unimported until it runs.
"""

"""torch._scaled_mm's CUDA contract, checked on the CPU: a replacement of the CPU kernels of
`aten::_scaled_mm` and `aten::_scaled_mm.out` that records every rule a call breaks and computes the
reference product (so FP8 modules run through it as through the GPU kernel).

The rules, from PyTorch's CUDA sources (aten/src/ATen/native/cuda/ScaledBlas.cpp, `_scaled_mm_out_cuda`
and `get_joint_scaling`; torch/_meta_registrations.py, `_check_scaled_mm_sizes`): 2-D operands whose
inner dimensions agree; mat1 row-major, mat2 column-major (cuBLASLt's "TN" only); mat1's columns and
both dimensions of mat2 multiples of 16; FP8 operands (float8_e4m3fn / float8_e5m2, never e5m2 x
e5m2) or both packed FP4; scales by kind, tried in torch's order: tensorwise (fp32 singletons),
DeepSeek blocks (fp32; 1x128 [rows, K/128] outer-dim-major as scale_a, its transpose's layout as
scale_b; 128x128 [rows/128, K/128] inner-dim-major), MX 1x32 (float8_e8m0fnu, round_up(rows, 128) *
round_up(K/32, 4) elements, contiguous) and NVFP4 1x16 (float8_e4m3fn scales, same rounding with
K/16); output bf16/fp16/fp32 (or FP8); a bias of N elements, bf16/fp16, matching the output, never
with fp32 output; no fast accumulation with FP4; 16-byte aligned data and leading dimensions.
Row-wise scales are valid CUDA but fp8train never passes them: the checker reports them too.

Written from the rules, not from fp8train's layout code: the blocked scale layout is read back with
cuBLAS's offset formula, E2M1 nibbles with their own table.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4 = getattr(torch, "float4_e2m1fn_x2", None)
E8M0 = getattr(torch, "float8_e8m0fnu", None)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + FP8
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_major(t: torch.Tensor) -> bool:
    rows, cols = t.shape
    return rows == 0 or cols == 0 or (t.stride(1) == 1 and t.stride(0) >= max(cols, 1))


def _col_major(t: torch.Tensor) -> bool:
    rows, cols = t.shape
    return rows == 0 or cols == 0 or (t.stride(0) == 1 and t.stride(1) >= max(rows, 1))


def _size_stride(scale: torch.Tensor, dim: int, size: int, stride: int) -> bool:
    return scale.size(dim) == size and (size <= 1 or scale.stride(dim) == stride)


def _unblock(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Per-row scales [rows, cols] read from cuBLAS's blocked layout with its offset formula."""
    col_tiles = _cdiv(cols, 4)
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    tile = (r // 128) * col_tiles + c // 4
    offset = tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    return blocked.reshape(-1)[offset]


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """float32 values [rows, 2 * cols] of E2M1 nibbles [rows, cols] (element 2i in the low nibble)."""
    byte = packed.view(torch.uint8).to(torch.int64)
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    return torch.stack([table[byte & 0xF], table[byte >> 4]], dim=-1).flatten(-2)


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    byte = scale.view(torch.uint8).to(torch.float64)
    return torch.where(byte == 255, float("nan"), torch.exp2(byte - 127)).to(torch.float32)


class ContractChecker:
    """Counts calls and records violations (each a message naming the rule and the call)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.violations: list[str] = []

    def _need(self, ok: bool, rule: str, call: dict) -> None:
        if not ok:
            self.violations.append(f"{rule} (call {len(self.calls)}: {call['summary']})")

    def _scaling(self, a, b, sa, sb, call) -> Optional[str]:
        """The kind of scaling, checked as torch's get_joint_scaling tries them, or None."""
        m, k = a.shape
        n = b.shape[1]
        fp8 = a.dtype in FP8 and b.dtype in FP8
        if fp8 and sa.dtype == sb.dtype == torch.float32 and sa.numel() == 1 and sb.numel() == 1:
            return "tensorwise"
        if fp8 and sa.dtype == sb.dtype == torch.float32 and sa.dim() == 2 and sb.dim() == 2:
            kb = _cdiv(k, 128)
            # torch checks scale_b against b.t() [N, K]: the layouts below are of scale_b.t()
            sbt = sb.t()
            a_1x128 = _size_stride(sa, 0, m, 1) and _size_stride(sa, 1, kb, m)
            a_128 = _size_stride(sa, 0, _cdiv(m, 128), kb) and _size_stride(sa, 1, kb, 1)
            b_1x128 = _size_stride(sbt, 0, n, 1) and _size_stride(sbt, 1, kb, n)
            b_128 = _size_stride(sbt, 0, _cdiv(n, 128), kb) and _size_stride(sbt, 1, kb, 1)
            rowwise = sa.shape == (m, 1) and sb.shape == (1, n)
            if rowwise:
                self._need(False, "row-wise scales (valid CUDA, never fp8train's)", call)
                return "rowwise"
            for kind, ok in (("128x128,1x128", a_128 and b_1x128), ("1x128,128x128", a_1x128 and b_128),
                             ("1x128,1x128", a_1x128 and b_1x128)):  # fmt: skip
                if ok:
                    return kind
            return None
        if fp8 and E8M0 is not None and sa.dtype == sb.dtype == E8M0:
            ok_a = sa.numel() == _cdiv(m, 128) * 128 * _cdiv(_cdiv(k, 32), 4) * 4 and sa.is_contiguous()
            ok_b = sb.numel() == _cdiv(n, 128) * 128 * _cdiv(_cdiv(k, 32), 4) * 4 and sb.is_contiguous()
            return "mx" if ok_a and ok_b else None
        if FP4 is not None and a.dtype == b.dtype == FP4 and sa.dtype == sb.dtype == torch.float8_e4m3fn:
            ok_a = sa.numel() == _cdiv(m, 128) * 128 * _cdiv(_cdiv(2 * k, 16), 4) * 4 and sa.is_contiguous()
            ok_b = sb.numel() == _cdiv(n, 128) * 128 * _cdiv(_cdiv(2 * k, 16), 4) * 4 and sb.is_contiguous()
            return "nvfp4" if ok_a and ok_b else None
        return None

    def check(self, a, b, sa, sb, bias, scale_result, out_dtype, fast_accum, out=None) -> str:
        summary = (
            f"{tuple(a.shape)}{tuple(a.stride())} {a.dtype} x {tuple(b.shape)}{tuple(b.stride())} {b.dtype}, "
            f"scales {sa.dtype}{tuple(sa.shape)}{tuple(sa.stride())} / "
            f"{sb.dtype}{tuple(sb.shape)}{tuple(sb.stride())}, "
            f"out {out_dtype}, bias {None if bias is None else bias.dtype}, fast_accum {fast_accum}"
        )
        call = {"summary": summary}
        need = self._need
        need(a.dim() == 2 and b.dim() == 2, "operands must be 2-D", call)
        need(a.shape[1] == b.shape[0], "inner dimensions differ", call)
        operand_types = FP8 + ((FP4,) if FP4 is not None else ())
        need(
            a.dtype in operand_types and b.dtype in operand_types, "operands must be FP8 or packed FP4", call
        )
        need((a.dtype == FP4) == (b.dtype == FP4), "FP4 only with FP4", call)
        need(not (a.dtype == b.dtype == torch.float8_e5m2), "e5m2 x e5m2 is not supported", call)
        need(_row_major(a), "mat1 must be row-major", call)
        need(_col_major(b), "mat2 must be column-major", call)
        need(a.shape[1] % 16 == 0, "mat1.size(1) must be a multiple of 16", call)
        need(
            b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0,
            "both dimensions of mat2 must be multiples of 16",
            call,
        )
        for name, t in (("mat1", a), ("mat2", b)):
            need(t.data_ptr() % 16 == 0, f"{name} must be 16-byte aligned", call)
        need(
            a.shape[0] <= 1 or (a.stride(0) * a.element_size()) % 16 == 0,
            "mat1's leading dimension: 16 bytes",
            call,
        )
        need(
            b.shape[1] <= 1 or (b.stride(1) * b.element_size()) % 16 == 0,
            "mat2's leading dimension: 16 bytes",
            call,
        )
        out_dtype = out_dtype if out_dtype is not None else a.dtype
        need(out_dtype in OUT_DTYPES, f"output dtype {out_dtype} is not supported", call)
        if bias is not None:
            need(bias.numel() == b.shape[1], "bias must have N elements", call)
            need(out_dtype != torch.float32, "no bias with fp32 output", call)
            need(bias.dtype in (torch.bfloat16, torch.float16), "bias must be bf16 or fp16", call)
            need(
                out_dtype not in (torch.bfloat16, torch.float16) or bias.dtype == out_dtype,
                "bias dtype = out",
                call,
            )
        need(scale_result is None or (scale_result.numel() == 1 and scale_result.dtype == torch.float32),
             "scale_result must be an fp32 scalar", call)  # fmt: skip
        need(not (fast_accum and a.dtype == FP4), "no fast accumulation with FP4", call)
        kind = self._scaling(a, b, sa, sb, call)
        need(kind is not None, "invalid scaling configuration", call)
        if out is not None:
            need(out.dtype == out_dtype, "out's dtype must be out_dtype", call)
            need(out.data_ptr() % 16 == 0 or out.numel() == 0, "out must be 16-byte aligned", call)
        call["kind"], call["out"] = kind, out is not None
        self.calls.append(call)
        return kind or "invalid"

    def compute(self, a, b, sa, sb, bias, out_dtype, kind: str) -> torch.Tensor:
        """The reference product: operands dequantized with their scales, an fp64 matmul."""
        m, k = a.shape
        n = b.shape[1]
        if a.dtype == FP4:
            av, bv = _unpack_fp4(a), _unpack_fp4(b.t()).t()
            k = 2 * k
        else:
            av, bv = a.float(), b.float()
        if kind == "tensorwise":
            av, bv = av * sa.float().reshape(()), bv * sb.float().reshape(())
        elif kind in ("1x128,128x128", "128x128,1x128", "1x128,1x128"):
            left, right = kind.split(",")
            ra = 128 if left == "128x128" else 1
            av = av * sa.float().repeat_interleave(ra, 0)[:m].repeat_interleave(128, 1)[:, :k]
            # scale_b is of b [K, N]: per 128 rows of K, per 128 (or 1) columns
            rb = 128 if right == "128x128" else 1
            bv = bv * sb.float().repeat_interleave(128, 0)[:k].repeat_interleave(rb, 1)[:, :n]
        elif kind in ("mx", "nvfp4"):
            block = 32 if kind == "mx" else 16
            decode = _e8m0 if kind == "mx" else (lambda s: s.float())
            per_a = decode(_unblock(sa, m, _cdiv(k, block)))
            per_b = decode(_unblock(sb, n, _cdiv(k, block)))
            av = av * per_a.repeat_interleave(block, 1)[:, :k]
            bv = (bv.t() * per_b.repeat_interleave(block, 1)[:, :k]).t()
        else:
            return torch.full((m, n), float("nan")).to(out_dtype if out_dtype is not None else torch.float32)
        y = av.double() @ bv.double()
        if bias is not None:
            y = y + bias.double()
        return y.to(out_dtype if out_dtype is not None else a.dtype)


@contextlib.contextmanager
def cuda_contract() -> Iterator[ContractChecker]:
    """Within: torch._scaled_mm on the CPU is the checker (both the functional and the out= form,
    which inductor calls). The override is removed on exit, whatever happens."""
    checker = ContractChecker()

    def functional(
        a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
    ):
        kind = checker.check(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
        return checker.compute(a, b, scale_a, scale_b, bias, out_dtype, kind)

    def out_form(
        a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False, *, out
    ):
        kind = checker.check(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum, out)
        result = checker.compute(a, b, scale_a, scale_b, bias, out_dtype, kind)
        out.resize_(result.shape)
        return out.copy_(result)

    library = torch.library.Library("aten", "IMPL")
    with _quiet_override():
        library.impl("_scaled_mm", functional, "CPU")
        library.impl("_scaled_mm.out", out_form, "CPU")
    try:
        yield checker
    finally:
        library._destroy()


@contextlib.contextmanager
def _quiet_override() -> Iterator[None]:
    """torch warns when a kernel replaces a registered one: here that is the point."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
        yield


def relative_bound(k: int) -> float:
    """A bound on the relative error (to sum |a_i b_i|) of an fp32 dot product of k exact products
    in any order: gamma_k = k u / (1 - k u), u = 2**-24."""
    u = 2.0**-24
    return k * u / (1 - k * u) if k * u < 1 else math.inf


# ---- torch._scaled_grouped_mm ------------------------------------------------------------------------------
# The rules of its CUDA kernel (aten/src/ATen/native/cuda/GroupedBlas.cpp, `_scaled_grouped_mm_cuda` and
# `_check_scales_fp8_rowwise`; torch/_meta_registrations.py, `_meta_grouped_mm_common`): a device of
# compute capability 9.x or 10.x; E4M3 operands (row-wise scales: no E5M2); mat_a row-major, mat_b
# column-major in their last two dimensions, leading dimensions of 16 bytes; mat_a's last dimension and
# both of mat_b's multiples of 16; 2-D or 3-D operands with matching contraction; `offs` (1-D int32) given
# exactly when an operand is 2-D; no bias, no scale_result; bf16 output. Row-wise scales, fp32: a 2-D
# operand's scale is 1-D, contiguous, one per row of mat_a (per column of mat_b), times the number of
# groups when both are 2-D (one block per group); a 3-D operand's scale is 2-D (groups, rows or columns),
# contiguous in its last dimension. Beyond torch's host checks, the kernel reads the groups with TMA
# along the jagged dimension: fp8train keeps every group a multiple of 16 rows (torchao's alignment of
# token groups for this kernel), and the checker holds it to that. Rows past offs[-1] and the weight
# gradient of an empty group are left undefined here (NaN): fp8train must not read them.
# MXFP8 (both scales float8_e8m0fnu; the MX kernel, SM100): torch's meta check asks a 2-D operand's scale
# to be 2-D and contiguous, a 3-D operand (groups, K, N)'s to be 2-D, contiguous in its last dimension,
# (groups, round_up(K/32, 4) * round_up(N, 128)): each expert's per-column scales [N, K/32] in cuBLAS's
# blocked layout. The 2-D operand's sizes torch cannot check at trace time (they depend on offs): its
# scales are each group's [rows_g, K/32] in the blocked layout on its own (padded to 128 rows and 4
# columns), the groups' blocks one after the other (torch's test helpers and torchao build them so),
# i.e. [sum of round_up(rows_g, 128), round_up(K/32, 4)]; the checker holds the call to exactly that.
# K must be whole blocks of 32, and the checker holds MX token groups to 32 rows (MXFP8 quantizes
# tokens in whole 32s; torchao aligns its MX token groups so). Only the 2d-3d MX form is modelled
# (fp8train calls no other): any other MX form is reported.
GROUP_ALIGN = 16
MX_GROUP_ALIGN = 32


class GroupedContractChecker(ContractChecker):
    """Counts torch._scaled_grouped_mm calls and records the rules they break."""

    def check_grouped(self, a, b, sa, sb, offs, bias, scale_result, out_dtype) -> Optional[list[int]]:
        """The groups' sizes along the jagged dimension (None where offs is unusable)."""
        call = {
            "summary": (
                f"grouped {tuple(a.shape)}{tuple(a.stride())} {a.dtype} x "
                f"{tuple(b.shape)}{tuple(b.stride())} {b.dtype}, "
                f"scales {sa.dtype}{tuple(sa.shape)}{tuple(sa.stride())} / "
                f"{sb.dtype}{tuple(sb.shape)}{tuple(sb.stride())}, offs "
                f"{None if offs is None else (offs.dtype, offs.tolist())}, out {out_dtype}"
            )
        }
        need = self._need
        need(a.dim() in (2, 3) and b.dim() in (2, 3), "operands must be 2-D or 3-D", call)
        need(a.dtype == b.dtype == torch.float8_e4m3fn, "operands must both be float8_e4m3fn", call)
        need(a.stride(-1) == 1 and a.stride(-2) >= max(1, a.shape[-1]), "mat_a must be row-major", call)
        need(b.stride(-2) == 1 and b.stride(-1) >= max(1, b.shape[-2]), "mat_b must be column-major", call)
        need(a.shape[-1] % 16 == 0, "mat_a's last dimension must be a multiple of 16", call)
        need(
            b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0,
            "mat_b's dimensions must be multiples of 16",
            call,
        )
        need((a.stride(-2) * a.element_size()) % 16 == 0, "mat_a's leading dimension: 16 bytes", call)
        need((b.stride(-1) * b.element_size()) % 16 == 0, "mat_b's leading dimension: 16 bytes", call)
        for name, t in (("mat_a", a), ("mat_b", b)):
            need(t.data_ptr() % 16 == 0, f"{name} must be 16-byte aligned", call)
        two_d = a.dim() == 2 and b.dim() == 2
        if not two_d:
            need(a.shape[-1] == b.shape[-2], "contraction dimensions differ", call)
        need(bias is None, "no bias (torch: not supported yet)", call)
        need(scale_result is None, "no scale_result", call)
        need(out_dtype in (None, torch.bfloat16), "the output must be bf16", call)
        sizes = None
        need(
            (offs is not None) == (a.dim() == 2 or b.dim() == 2), "offs exactly when an operand is 2-D", call
        )
        if offs is not None:
            need(offs.dim() == 1 and offs.dtype == torch.int32, "offs must be a 1-D int32 tensor", call)
            ends = offs.tolist()
            jagged = a.shape[1] if two_d else a.shape[0]
            sizes = [e - s for s, e in zip([0] + ends[:-1], ends)]
            need(all(n >= 0 for n in sizes) and (not ends or ends[-1] <= jagged),
                 "offs must be non-decreasing and within the jagged dimension", call)  # fmt: skip
            need(
                all(n % GROUP_ALIGN == 0 for n in sizes),
                f"every group a multiple of {GROUP_ALIGN} rows",
                call,
            )
            if a.dim() == 2 and b.dim() == 3:
                need(len(ends) == b.shape[0], "one offset per expert of mat_b", call)
        if E8M0 is not None and sa.dtype == sb.dtype == E8M0:
            self._check_mx_scales(a, b, sa, sb, sizes, call)
            call["kind"] = f"grouped mx {a.dim()}d-{b.dim()}d"
            self.calls.append(call)
            return sizes
        need(sa.dtype == sb.dtype == torch.float32, "row-wise scales must be float32 (or both E8M0)", call)
        groups = len(offs) if offs is not None else a.shape[0]
        multiplier = groups if two_d else 1
        for name, scale, mat, dim in (("scale_a", sa, a, 0), ("scale_b", sb, b, 1)):
            if mat.dim() == 2:
                need(scale.dim() == 1 and scale.is_contiguous(), f"{name} must be 1-D and contiguous", call)
                what = f"{name}: one per {'row' if dim == 0 else 'column'}" + (" per group" if two_d else "")
                need(scale.numel() == mat.shape[dim] * multiplier, what, call)
            else:
                need(scale.dim() == 2 and scale.stride(1) == 1, f"{name} must be 2-D, contiguous rows", call)
                need(tuple(scale.shape) == (mat.shape[0], mat.shape[1 + dim]),
                     f"{name} must be (groups, {'rows' if dim == 0 else 'columns'})", call)  # fmt: skip
        call["kind"] = "grouped 2d-2d" if two_d else f"grouped {a.dim()}d-{b.dim()}d"
        self.calls.append(call)
        return sizes

    def _check_mx_scales(self, a, b, sa, sb, sizes, call) -> None:
        need = self._need
        need(a.dim() == 2 and b.dim() == 3, "the checker models MX scales of the 2d-3d form only", call)
        if not (a.dim() == 2 and b.dim() == 3):
            return
        k, n = b.shape[1], b.shape[2]
        need(k % 32 == 0, "MX: the contraction dimension must be whole blocks of 32", call)
        columns = _cdiv(k // 32, 4) * 4
        need(sa.dim() == 2 and sa.is_contiguous(), "MX scale_a must be 2-D and contiguous", call)
        if sizes is not None:
            aligned = all(g % MX_GROUP_ALIGN == 0 for g in sizes)
            need(aligned, f"MX: every group a multiple of {MX_GROUP_ALIGN} rows", call)
            rows = sum(_cdiv(g, 128) * 128 for g in sizes)
            need(tuple(sa.shape) == (rows, columns),
                 f"MX scale_a must be each group's blocked scales: ({rows}, {columns})", call)  # fmt: skip
        need(sb.dim() == 2 and sb.stride(-1) == 1, "MX scale_b must be 2-D, contiguous in its last dim", call)
        need(tuple(sb.shape) == (b.shape[0], columns * _cdiv(n, 128) * 128),
             f"MX scale_b must be (groups, {columns * _cdiv(n, 128) * 128})", call)  # fmt: skip

    def compute_grouped(self, a, b, sa, sb, sizes) -> torch.Tensor:
        """Each group's product of dequantized operands (fp32 values times their fp32 scales, an fp64
        matmul, rounded once to bf16), as `compute` makes one torch._scaled_mm's."""
        if E8M0 is not None and sa.dtype == E8M0:
            return self._compute_mx(a, b, sa, sb, sizes)
        if a.dim() == 2 and b.dim() == 3:
            out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=torch.float64)
            start = 0
            for g, n in enumerate(sizes or []):
                av = a[start : start + n].float() * sa[start : start + n].float()[:, None]
                bv = b[g].float() * sb[g].float()[None, :]
                out[start : start + n] = av.double() @ bv.double()
                start += n
            return out.to(torch.bfloat16)
        if a.dim() == 2 and b.dim() == 2:
            m, n_out = a.shape[0], b.shape[1]
            out = torch.full((len(sizes or []), m, n_out), float("nan"), dtype=torch.float64)
            start = 0
            for g, n in enumerate(sizes or []):
                if n:
                    av = a[:, start : start + n].float() * sa[g * m : (g + 1) * m].float()[:, None]
                    bv = b[start : start + n].float() * sb[g * n_out : (g + 1) * n_out].float()[None, :]
                    out[g] = av.double() @ bv.double()
                start += n
            return out.to(torch.bfloat16)
        return torch.full((1,), float("nan"), dtype=torch.bfloat16)

    def _compute_mx(self, a, b, sa, sb, sizes) -> torch.Tensor:
        """2d-3d with MX scales: each group's rows and its expert dequantized with the scales read back
        from their blocks (the checker's own `_unblock`, cuBLAS's offset formula), an fp64 matmul,
        rounded once to bf16 (what `compute` makes one MX torch._scaled_mm's)."""
        k, n = b.shape[1], b.shape[2]
        blocks = k // 32
        columns = _cdiv(blocks, 4) * 4
        out = torch.full((a.shape[0], n), float("nan"), dtype=torch.float64)
        flat_a = sa.reshape(-1)
        start, scale_row = 0, 0
        for g, rows in enumerate(sizes or []):
            padded = _cdiv(rows, 128) * 128
            group_scales = flat_a[scale_row * columns : (scale_row + padded) * columns]
            per_a = _e8m0(_unblock(group_scales, rows, blocks)).repeat_interleave(32, 1)
            per_b = _e8m0(_unblock(sb[g], n, blocks)).repeat_interleave(32, 1)  # [N, K]
            av = a[start : start + rows].float() * per_a
            bv = b[g].t().float() * per_b  # [N, K]
            out[start : start + rows] = av.double() @ bv.double().t()
            start, scale_row = start + rows, scale_row + padded
        return out.to(torch.bfloat16)


def _grouped_shape(a, b, offs) -> tuple[int, ...]:
    if a.dim() == 2 and b.dim() == 2:
        return (0 if offs is None else len(offs), a.shape[0], b.shape[1])
    if a.dim() == 2:
        return (a.shape[0], b.shape[-1])
    return (a.shape[0], a.shape[1], b.shape[-1]) if b.dim() == 3 else (a.shape[1], b.shape[1])


@contextlib.contextmanager
def cuda_grouped_contract() -> Iterator[GroupedContractChecker]:
    """Within: torch._scaled_grouped_mm has a CPU kernel, the checker (torch has none). Removed on exit."""
    checker = GroupedContractChecker()

    def functional(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                   use_fast_accum=False):  # fmt: skip
        before = len(checker.violations)
        sizes = checker.check_grouped(a, b, scale_a, scale_b, offs, bias, scale_result, out_dtype)
        if len(checker.violations) > before:  # a call CUDA refuses: no product (NaN, of the meta's shape)
            meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in (a, b, scale_a, scale_b)]
            return torch.full(_grouped_shape(meta[0], meta[1], offs), float("nan"), dtype=torch.bfloat16)
        return checker.compute_grouped(a, b, scale_a, scale_b, sizes)

    library = torch.library.Library("aten", "IMPL")
    with _quiet_override():
        library.impl("_scaled_grouped_mm", functional, "CPU")
    try:
        yield checker
    finally:
        library._destroy()

"""The groups of a grouped FP8 call in one GEMM per role: `torch._scaled_grouped_mm` where the device
has it (docs/design.md, section 9.2, "Native grouped GEMMs").

A grouped call (grouped_linear.py) runs `fp8_linear` once per group; with a `GroupedGEMMs` handed down,
each group's call does everything a Linear's does (its plan, amaxes, scales, the weight's cast or
cache) and hands its operands here instead of multiplying them. Where the collection takes the call
(`GroupedGEMMs.takes`, decided once per module call), the layer's three GEMMs are:

- forward: the rows of every group times its expert's weight, one `_scaled_grouped_mm` (2-D rows,
  3-D stack of column-major weights, `offs` the groups' int32 end rows);
- dgrad: the same form, the output gradient's rows times each expert's weight;
- wgrad: one `_scaled_grouped_mm` whose groups run along the reduction (2-D x 2-D), the tokens.

What takes it: per-tensor recipes (delayed and current scaling; `Quantization.kernel` "tensorwise"),
each group's tensors with their own scale, passed as row-wise scales: every row of a group's input
(or gradient) carries the group's scale_inv, every column of an expert's weight the weight's. The
kernel multiplies E4M3 by E4M3 and writes bf16 only, so a role takes it where both operands are E4M3
and its output is bf16: with Format.HYBRID the gradients are E5M2, so dgrad and wgrad run one
torch._scaled_mm per group (Format.E4M3 groups all three); fp32 weights' gradients (fp32 master
weights) run per group too (an fp32 output, as a Linear's), never rounded to bf16 behind the user's
back. MXFP8 (`Quantization.kernel` "mxfp8") takes it on compute capability 10.x only (torch's MX
grouped kernel, SM100), for forward and dgrad (2d-3d): E8M0 scales per 32 values along K, each group's
rows of scales in cuBLAS's blocked layout on their own (padded to 128 rows and to 4 scale columns, the
groups' blocks one after the other: a 2-D [sum of round_up(rows_g, 128), round_up(K/32, 4)]), each
expert's in the same layout, stacked [experts, round_up(K/32, 4) * round_up(N, 128)] (torch's meta
check); the groups need no row padding (MXFP8 refuses tokens off 32). Its wgrad runs one MX
torch._scaled_mm per expert: the K-grouped (2d-2d) MX form's scale layout (each group's 32-token
blocks, blocked per group along the reduction) is not checked by torch's meta function, so it is not
pinned down here. Block scaling (1x128/128x128 blocks: no grouped kernel in torch) and NVFP4 (no FP4
grouped kernel in torch's CUDA builds used here) keep the per-group path.

Groups off 16 rows (the kernel's alignment along the tokens, the wgrad's reduction) are padded with
zero FP8 rows while the groups' operands are concatenated (which the grouped GEMM needs anyway): cast
before padding, the zeros change no amax, no output row and no weight gradient. An empty group (0
tokens) is a group of 0 rows (its weight gradient set to 0 here, not left to the kernel).

`FP8TRAIN_GROUPED_GEMM` = auto (default) | off: off runs one GEMM per group everywhere.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from ..fsdp import GatheredWeight
from ..numerics.block_scaled_mm import k_major, mx_blocked_scales
from ..numerics.gemm import Operand, fast_accumulation, kernel_choice, matmul, operand_dtype
from ..second_order import refuse_create_graph
from ..torch_internals import cuda_capability, device_index, scaled_grouped_mm, scaled_grouped_mm_problem

__all__ = ["GroupedGEMMs", "grouped_kernel_choice", "ALIGN_ROWS", "ENV_GROUPED_GEMM", "GROUPED_KERNELS"]

ENV_GROUPED_GEMM = "FP8TRAIN_GROUPED_GEMM"
ALIGN_ROWS = 16  # each group's rows, padded to it for the grouped kernel (16 bytes of E4M3)
MX_BLOCK = 32  # MXFP8's values per E8M0 scale, along K
# the recipes' kernels (`Quantization.kernel`) the grouped kernel takes, and the compute capabilities
# (major) of its CUTLASS kernels: row-wise scales on SM90 and SM100, MX scales on SM100
GROUPED_KERNELS = {"tensorwise": (9, 10), "mxfp8": (10,)}
_E4M3 = torch.float8_e4m3fn
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _setting() -> str:
    value = (os.environ.get(ENV_GROUPED_GEMM) or "auto").strip() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"{ENV_GROUPED_GEMM}={value!r} is not valid: use auto or off")
    return value


def grouped_kernel_choice(device: torch.device, kernel: str = "tensorwise") -> tuple[bool, str]:
    """Whether grouped FP8 GEMMs on `device` under a recipe whose kernel is `kernel` ("tensorwise":
    delayed and current scaling; "mxfp8") take `torch._scaled_grouped_mm`, and why: the setting
    (`FP8TRAIN_GROUPED_GEMM`), the recipe's FP8 GEMM choice (`gemm.kernel_choice`: FP8TRAIN_GEMM,
    CUDA, or the CPU with FP8TRAIN_GEMM=scaled_mm), the GPU's compute capability (torch's CUTLASS
    kernels: 9.x and 10.x with row-wise scales, 10.x with MX scales), then one probe of the op per
    device and kernel (torch_internals)."""
    if kernel not in GROUPED_KERNELS:
        return False, f"torch._scaled_grouped_mm has no {kernel} form: one GEMM per group"
    if _setting() == "off":
        return False, f"{ENV_GROUPED_GEMM}=off runs one GEMM per group"
    native, why = kernel_choice(kernel, device)
    if not native:
        return False, why
    if device.type == "cuda":
        cap, majors = cuda_capability(device_index(device)), GROUPED_KERNELS[kernel]
        if cap[0] not in majors:
            needs = (
                "9.x or 10.x (Hopper, Blackwell B200/GB200)" if 9 in majors else "10.x (Blackwell B200/GB200)"
            )
            return False, (
                f"torch._scaled_grouped_mm's {kernel} kernel needs compute capability {needs}; this GPU has "
                f"{cap[0]}.{cap[1]}: one torch._scaled_mm per group"
            )
    problem = scaled_grouped_mm_problem(device.type, device_index(device), kernel)
    if problem:
        return False, problem
    return True, f"torch._scaled_grouped_mm runs on {device.type} (probed)"


def _padded(splits: Sequence[int]) -> list[int]:
    return [-(-n // ALIGN_ROWS) * ALIGN_ROWS for n in splits]


def _offsets(padded: Sequence[int], device: torch.device) -> torch.Tensor:
    """The groups' int32 end rows on `device`, from the host sizes: on CUDA one asynchronous copy from
    pinned memory (the host does not wait for the GPU)."""
    ends, total = [], 0
    for n in padded:
        total += n
        ends.append(total)
    host = torch.tensor(ends, dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _rows(operands: Sequence[Operand], splits, padded) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The groups' operands (each rows x features, as oriented) one under the other, each followed by
    zero rows up to its padded count: (values, row-major; each group's scale_inv as a 1-element fp32)."""
    pieces, scales = [], []
    for op, n, p in zip(operands, splits, padded):
        values = op.oriented()
        pieces.append(values)
        if p > n:
            pieces.append(values.new_zeros(p - n, values.shape[1]))
        scales.append(op.scale_inv.reshape(1).float())
    return torch.cat(pieces), scales


def _grouped_mx_rows_gemm(
    a_ops: Sequence[Operand], b_ops: Sequence[Operand], splits, role: str
) -> torch.Tensor:
    """Group g's MXFP8 rows a_ops[g] (n_g x k, blocks of 32 along k) times b_ops[g] (k x n): one
    torch._scaled_grouped_mm (2-D x 3-D, bf16) with E8M0 scales, each group's in the blocked layout on
    its own (`mx_blocked_scales`, as one MX torch._scaled_mm's: the same bytes), one after the other."""
    ka = [k_major(op, True) for op in a_ops]
    kb = [k_major(op, False) for op in b_ops]
    k = ka[0].values.shape[1]
    scale_columns = -(-(k // MX_BLOCK) // 4) * 4
    mat_a = torch.cat([op.values for op in ka]).contiguous()
    scale_a = torch.cat([mx_blocked_scales(op) for op in ka]).view(-1, scale_columns)
    experts = torch.stack([op.values for op in kb]).contiguous()  # (groups, n, k)
    scale_b = torch.stack([mx_blocked_scales(op) for op in kb])  # (groups, blocked n * blocked k)
    offs = _offsets(list(splits), mat_a.device)
    return scaled_grouped_mm(
        mat_a, experts.transpose(-2, -1), scale_a, scale_b, offs, fast_accumulation(role)
    )


def _repeat(scales: Sequence[torch.Tensor], counts: Sequence[int]) -> torch.Tensor:
    """Each group's scale `counts[g]` times, one after the other (fp32, 1-D, contiguous)."""
    return torch.cat([s.expand(c) for s, c in zip(scales, counts)])


def _one_gemm(a: Operand, b: Operand, out_dtype: torch.dtype, role: str) -> torch.Tensor:
    """One group's GEMM as a Linear's: torch._scaled_mm where every dimension is whole 16s, else the
    exact emulation of the bf16 path (FP8 values converted exactly to its operand dtype), as
    `fp8_linear` chooses for a Linear of that many tokens."""
    (m, k), n = a.oriented().shape, b.oriented().shape[1]
    if a.values.dtype in _FP8 and not all(d % 16 == 0 and d > 0 for d in (m, k, n)):
        held = operand_dtype("bf16", a.values.device)
        a = Operand(a.values.to(held), a.scale_inv, a.block, a.transposed)
        b = Operand(b.values.to(held), b.scale_inv, b.block, b.transposed)
        return matmul(a, b, out_dtype, role=role, path="bf16")
    return matmul(a, b, out_dtype, role=role, path="scaled_mm")


def _grouped_rows_gemm(
    a_ops: Sequence[Operand],
    b_ops: Sequence[Operand],
    splits,
    out_dtype: torch.dtype,
    role: str,
    kernel: str = "tensorwise",
) -> torch.Tensor:
    """Group g's rows a_ops[g] (n_g x k) times b_ops[g] (k x n), the groups' outputs one under the
    other: one torch._scaled_grouped_mm (2-D x 3-D) where the operands are E4M3 with a bf16 output,
    else one GEMM per group (`_one_gemm`)."""
    e4m3 = all(op.values.dtype == _E4M3 for op in (*a_ops, *b_ops))
    if not (e4m3 and out_dtype == torch.bfloat16):
        return torch.cat([_one_gemm(a, b, out_dtype, role) for a, b in zip(a_ops, b_ops)])
    if kernel == "mxfp8":
        return _grouped_mx_rows_gemm(a_ops, b_ops, splits, role)
    padded = _padded(splits)
    device = a_ops[0].values.device
    mat_a, a_scales = _rows(a_ops, splits, padded)
    # each expert's (k x n) operand column-major: the stack of their transposes, contiguous
    experts = torch.stack([op.oriented().t() for op in b_ops])  # (groups, n, k)
    n = experts.shape[1]
    scale_b = torch.cat([op.scale_inv.reshape(1, 1).float() for op in b_ops]).expand(-1, n).contiguous()
    y = scaled_grouped_mm(
        mat_a, experts.transpose(-2, -1), _repeat(a_scales, padded), scale_b, _offsets(padded, device),
        fast_accumulation(role),
    )  # fmt: skip
    if padded == list(splits):
        return y
    return torch.cat([part[:rows] for part, rows in zip(y.split(padded), splits)])


def _grouped_wgrad(
    g_ops: Sequence[Operand],
    x_ops: Sequence[Operand],
    splits,
    out_dtype: torch.dtype,
    kernel: str = "tensorwise",
) -> list[torch.Tensor]:
    """Each group's weight gradient g_g.T @ x_g (out x in): one torch._scaled_grouped_mm whose groups
    run along the tokens (2-D x 2-D) where the operands are E4M3 with a bf16 output and row-wise
    scales, else one GEMM per group (MXFP8's: the K-grouped MX form is not wired, module docstring)."""
    e4m3 = all(op.values.dtype == _E4M3 for op in (*g_ops, *x_ops))
    if not (e4m3 and out_dtype == torch.bfloat16) or kernel != "tensorwise":
        return [_one_gemm(g.t(), x, out_dtype, "wgrad") for g, x in zip(g_ops, x_ops)]
    padded = _padded(splits)
    g_rows, g_scales = _rows(g_ops, splits, padded)  # (tokens, out)
    x_rows, x_scales = _rows(x_ops, splits, padded)  # (tokens, in)
    out_features, in_features = g_rows.shape[1], x_rows.shape[1]
    groups = len(splits)
    y = scaled_grouped_mm(
        g_rows.t().contiguous(), x_rows.t().contiguous().t(),
        _repeat(g_scales, [out_features] * groups), _repeat(x_scales, [in_features] * groups),
        _offsets(padded, g_rows.device), fast_accumulation("wgrad"),
    )  # fmt: skip
    grads = list(y.unbind(0))
    return [torch.zeros_like(w) if rows == 0 else w for w, rows in zip(grads, splits)]


class GroupedGEMMs:
    """The GEMMs of one grouped call (`grouped_fp8_linear`): `fp8_linear` asks `takes` at each group's
    call; where it does, the group's operands are handed over (`add`) and `multiply` runs every group's
    GEMMs at once (`_GroupedLinearFn`). Decided once, at the first group, for all of them."""

    def __init__(self, weights: Sequence[torch.Tensor], splits: Sequence[int]) -> None:
        self.weights, self.splits = list(weights), list(splits)
        self.native: Optional[bool] = None
        self.why = ""
        self.out_dtype = torch.bfloat16
        self.kernel = "tensorwise"  # the recipe's kernel (`Quantization.kernel`), set by `takes`
        self.entries: list[tuple] = []

    def takes(self, call, out_dtype: torch.dtype) -> bool:
        """Whether this call's groups run their GEMMs here (every group's, or none)."""
        if self.native is None:
            self.native, self.why = self._decide(call, out_dtype)
            self.out_dtype = out_dtype
            self.kernel = call.quantization.kernel
        return self.native

    def _decide(self, call, out_dtype: torch.dtype) -> tuple[bool, str]:
        quantization = call.quantization
        if quantization is None or quantization.kernel not in GROUPED_KERNELS:
            return False, (
                "only per-tensor recipes (delayed, current scaling) and MXFP8 take torch._scaled_grouped_mm"
            )
        if out_dtype != torch.bfloat16:
            return False, f"the grouped kernel writes bf16 only; this call's output is {out_dtype}"
        if torch.compiler.is_compiling():
            return False, "traced calls run one GEMM per group"
        out_features, in_features = self.weights[0].shape
        if not all(d % 16 == 0 and d > 0 for d in (out_features, in_features)):
            return False, f"the features ({in_features} -> {out_features}) are not whole 16s"
        if any(isinstance(w, GatheredWeight) for w in self.weights):
            return False, "weights gathered by FSDP2 in FP8 run one GEMM per group"
        return grouped_kernel_choice(self.weights[0].device, quantization.kernel)

    def operand_path(self) -> tuple[str, torch.dtype]:
        """The GEMM path and operand dtype of every group's call (Call.for_gemm): FP8 operands."""
        return "scaled_mm", _E4M3

    def add(self, weight: torch.Tensor, bias: Optional[torch.Tensor], w_ops, call) -> None:
        """One group's weight operands and call, in group order."""
        self.entries.append((weight, bias, w_ops, call))

    def multiply(self, x2d: torch.Tensor) -> torch.Tensor:
        """Every group's output, in the rows of its input (the `splits` of `x2d`)."""
        weights = [e[0] for e in self.entries]
        biases = [e[1] for e in self.entries]
        y = _GroupedLinearFn.apply(x2d, self, self.out_dtype, *weights, *biases)
        calls = [e[3] for e in self.entries]
        if not torch.compiler.is_compiling():
            calls[0].note_output(y)  # the groups share their module call's plan
        return y


class _GroupedLinearFn(torch.autograd.Function):
    """y[rows of group g] = x[rows of group g] @ weight_g.T + bias_g for every group, the GEMMs of each
    role together (`_grouped_rows_gemm`, `_grouped_wgrad`); each group quantized by its own call."""

    @staticmethod
    def forward(ctx, x2d, batch: GroupedGEMMs, out_dtype, *params):
        groups = len(batch.entries)
        splits = batch.splits[:groups]
        calls = [e[3] for e in batch.entries]
        w_ops = [e[2] for e in batch.entries]
        biases = params[groups:]
        rows = x2d.split(splits)
        x_ops = [call.quantization.quantize_input(r, call) for r, call in zip(rows, calls)]
        y = _grouped_rows_gemm(
            [op.forward for op in x_ops], [w.forward.t() for w in w_ops], splits, out_dtype, "forward",
            batch.kernel,
        )  # fmt: skip
        if any(b is not None for b in biases):
            y = torch.cat([
                part if b is None else part + b.to(out_dtype) for part, b in zip(y.split(splits), biases)
            ])  # fmt: skip
        x_saved = [op.wgrad for op in x_ops]
        w_saved = [w.dgrad for w in w_ops]
        tensors = [t for op in (*x_saved, *w_saved) for t in op.tensors()]
        ctx.save_for_backward(*tensors, calls[0].module_handle, *[c.token for c in calls])
        ctx.layouts = [op.layout for op in (*x_saved, *w_saved)]
        ctx.calls = [c.without_tensors() for c in calls]
        ctx.splits, ctx.groups, ctx.kernel = splits, groups, batch.kernel
        ctx.x_dtype = x2d.dtype
        ctx.w_dtypes = [w.dtype for w in params[:groups]]
        ctx.b_dtypes = [None if b is None else b.dtype for b in biases]
        return y

    @staticmethod
    def backward(ctx, grad_y):
        groups, splits = ctx.groups, ctx.splits
        saved = ctx.saved_tensors
        operands = [Operand.rebuild(saved[3 * i : 3 * i + 3], ctx.layouts[i]) for i in range(2 * groups)]
        x_wgrad, w_dgrad = operands[:groups], operands[groups:]
        handle, tokens = saved[6 * groups], saved[6 * groups + 1 :]
        calls = [c.with_saved(handle, token) for c, token in zip(ctx.calls, tokens)]
        if torch.is_grad_enabled():
            refuse_create_graph("a grouped GEMM's gradients (torch._scaled_grouped_mm)")
        needs_x = ctx.needs_input_grad[0]
        needs_w = ctx.needs_input_grad[3 : 3 + groups]
        needs_b = ctx.needs_input_grad[3 + groups :]
        g2d = grad_y.reshape(-1, grad_y.shape[-1])
        g_rows = g2d.split(splits)
        grad_b = [
            g.sum(0).to(dtype) if dtype is not None and need else None
            for g, dtype, need in zip(g_rows, ctx.b_dtypes, needs_b)
        ]
        grad_x, grad_w = None, [None] * groups
        with torch.no_grad():
            needs = (needs_x, any(needs_w))
            g_ops = [c.quantization.quantize_grad(g, c, needs) for g, c in zip(g_rows, calls)]
            if needs_x:
                grad_x = _grouped_rows_gemm(
                    [op.dgrad for op in g_ops], w_dgrad, splits, ctx.x_dtype, "dgrad", ctx.kernel
                )
            if any(needs_w):
                g_wgrad = [op.wgrad for op in g_ops]
                if len(set(ctx.w_dtypes)) == 1:
                    grads = _grouped_wgrad(g_wgrad, x_wgrad, splits, ctx.w_dtypes[0], ctx.kernel)
                else:  # experts of different dtypes: one GEMM each, in its own
                    grads = [
                        _one_gemm(g.t(), x, d, "wgrad") for g, x, d in zip(g_wgrad, x_wgrad, ctx.w_dtypes)
                    ]
                grad_w = [g if need else None for g, need in zip(grads, needs_w)]
        return (grad_x, None, None, *grad_w, *grad_b)

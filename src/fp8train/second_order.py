"""Double backward (`create_graph=True`) through an FP8 GEMM: gradient penalties, R1, Jacobian terms.

The FP8 backward computes `grad_x = dq(g) @ dq(w)` and `grad_w = dq(g)^T @ dq(x)`, where `dq(t)` is a
tensor quantized to FP8 and dequantized. Under `create_graph=True` these keep exactly their FP8
values (the first-order numbers do not change), and their derivatives are those of the same products
with every quantization taken as the identity (the straight-through rule that FP8 training uses for
the first derivative too): d grad_x = dg @ dq(w) + dq(g) @ dw, d grad_w = dg^T @ dq(x) + dq(g)^T @ dx.
The products run in fp32 autograd ops on the dequantized operands, so the second derivative is exact
for those operands. docs/design.md, section 11.

The term dq(g)^T @ dx needs the high-precision input x, which the FP8 forward does not keep (keeping
it would cost the activation memory FP8 saves). When x requires grad, the weight gradient is
therefore returned through `refuse_second_order`, whose backward raises: differentiating a weight
gradient (a penalty on `p.grad`, MAML) through such a layer is an error naming `create_graph`, never
a number missing a term. Input gradients (WGAN-GP, R1, Jacobian penalties) are complete.
"""

from __future__ import annotations

import torch

__all__ = ["linear_grads", "refuse_second_order", "refuse_create_graph"]


def straight_through(hp: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a dequantized FP8 tensor) as the forward value, the identity to `hp` as the derivative."""
    hp = hp.float()
    return hp + (value.float() - hp).detach()


def differentiable(value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """`value` exactly (the FP8 result), with the derivatives of `surrogate` (its fp32 twin)."""
    return value + (surrogate - surrogate.detach()).to(value.dtype)


class _RefuseSecondOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad: torch.Tensor, anchor: torch.Tensor, what: str) -> torch.Tensor:
        ctx.what = what
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *_):
        refuse_create_graph(ctx.what)


def refuse_second_order(grad: torch.Tensor, anchor: torch.Tensor, what: str) -> torch.Tensor:
    """`grad`, whose own derivative raises (it would miss a term): see the module docstring. `anchor`
    (a tensor that requires grad, e.g. the weight) puts the refusal in the graph even when nothing
    that `grad` was computed from requires grad."""
    return _RefuseSecondOrder.apply(grad, anchor, what)


def refuse_create_graph(what: str) -> None:
    raise RuntimeError(
        f"create_graph=True: the derivative of {what} cannot be computed in FP8 training. Input "
        "gradients of FP8 layers can be differentiated (gradient penalties work); weight gradients of a "
        "layer whose input requires grad, and tensor-parallel or FSDP2-FP8-gathered layers, cannot. Run "
        "the forward whose gradients you differentiate outside the FP8 region (or with "
        "fp8_autocast(enabled=False)): FP8 modules then compute in high precision, fully differentiable"
    )


def linear_grads(
    grad_x: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    g: torch.Tensor,
    g_for_x: torch.Tensor,
    weight: torch.Tensor,
    w_deq: torch.Tensor,
    g_for_w: torch.Tensor,
    x_deq: torch.Tensor,
    x_requires_grad: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The FP8 `grad_x` (shape of x) and `grad_w` (out x in) made differentiable (module docstring).

    `g` is the gradient of the output as a (tokens x out) matrix, with its graph; `g_for_x` and
    `g_for_w` its dequantized FP8 values as each GEMM used them (the two may be quantized along
    different dimensions); `weight` is the layer's weight input (out x in), `w_deq` and `x_deq`
    (tokens x in) the dequantized FP8 operands of the forward."""
    if grad_x is not None:
        surrogate = straight_through(g, g_for_x) @ straight_through(weight, w_deq)
        grad_x = differentiable(grad_x, surrogate.view(grad_x.shape))
    if grad_w is not None:
        grad_w = differentiable(grad_w, straight_through(g, g_for_w).t() @ x_deq.float())
        if x_requires_grad:
            what = "the weight gradient of an FP8 layer whose input requires grad"
            grad_w = refuse_second_order(grad_w, weight, what)
    return grad_x, grad_w

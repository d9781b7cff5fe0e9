"""Small helpers shared by the tests: the repository's root, a model's FP8 state, content hashes,
plain SGD, and the small FP8 model, batches and training steps that tests of several seams share."""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any

import torch

import fp8train

REPO = pathlib.Path(__file__).resolve().parents[1]  # the repository (examples/, benchmarks/, docs/)


def fp8_state(model: torch.nn.Module) -> list[torch.Tensor]:
    """[amax_history, scale, scale_inv] of each direction of each FP8 module, in module order: six
    tensors per module (reading them completes pending reductions), as copies."""
    out = []
    for m in model.modules():
        if isinstance(m, fp8train.FP8Module):
            for key in ("scaling_fwd", "scaling_bwd"):
                meta = m.fp8_meta[key]
                out += [meta.amax_history.clone(), meta.scale.clone(), meta.scale_inv.clone()]
    return out


def digest(obj: Any) -> str:
    """A content hash of tensors, (nested) lists and dicts: tensors by dtype, shape and bytes."""
    h = hashlib.sha256()

    def feed(o: Any) -> None:
        if isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(repr(k).encode())
                feed(o[k])
        elif isinstance(o, (list, tuple)):
            for item in o:
                feed(item)
        elif isinstance(o, torch.Tensor):
            h.update(f"{o.dtype}{tuple(o.shape)}".encode())
            h.update(o.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(o).encode())

    feed(obj)
    return h.hexdigest()


def sgd(model: torch.nn.Module, lr: float) -> None:
    """Plain SGD: no optimizer state, so a resumed run needs only the model's state."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def fp8_mlp(seed: int = 0, widths: tuple[int, ...] = (16, 16, 16)) -> torch.nn.Sequential:
    """FP8 Linears with a GELU between them, initialised from `seed` (by default two FP8 modules: 6
    forward and 4 backward roles)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        if i:
            layers.append(torch.nn.GELU())
        layers.append(fp8train.Linear(a, b))
    return torch.nn.Sequential(*layers)


def rank_batch(rank: int, step: int, scale: float = 1.0) -> torch.Tensor:
    """An (8, 16) batch of `rank` at `step`: its own seed, and amaxes that grow with the rank."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=gen) * (1.0 + rank) * scale


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, recipe) -> float:
    """One training step: the forward in an FP8 region, the mean square as the loss, the optimizer's
    step; returns the loss."""
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        y = model(x)
    loss = y.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def sgd_step(model: torch.nn.Module, x: torch.Tensor, recipe, lr: float, between=None) -> float:
    """One training step with plain SGD: the forward and the mean-square loss in an FP8 region,
    `between()` (if given) while the region's forward reduction is in flight, the backward, the
    update; returns the loss."""
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        loss = model(x).square().mean()
    if between is not None:
        between()
    loss.backward()
    sgd(model, lr)
    return loss.item()


def mse_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x, target, recipe, enabled: bool = True):
    """One regression step: gradients cleared, the forward in an FP8 region (`enabled=False`: the
    same step in high precision), the mean squared error, the optimizer's step; returns the loss."""
    opt.zero_grad()
    with fp8train.fp8_autocast(enabled=enabled, fp8_recipe=recipe):
        out = model(x)
    loss = torch.nn.functional.mse_loss(out, target)
    loss.backward()
    opt.step()
    return loss.detach()


def fill_special(t: torch.Tensor, block: int) -> torch.Tensor:
    """The microscaling tests' special values, written into float32 `t` (at least 40 rows, 4 * block + 2
    columns) in place: zero blocks, -0.0, +-inf, NaN, a block with both, along rows and columns."""
    inf, nan = float("inf"), float("nan")
    t[0, :block] = 0.0
    t[1, :block] = -0.0
    t[2, 5], t[3, 7], t[4, 9] = inf, -inf, nan
    t[5, 1], t[5, 2] = inf, nan
    t[6, block : 2 * block] = inf
    t[7, ::3] = -inf
    t[8:40, 3 * block] = 0.0  # a column of zeros (a zero column-wise block)
    t[9:20, 4 * block + 1] = nan  # a column with NaNs
    return t

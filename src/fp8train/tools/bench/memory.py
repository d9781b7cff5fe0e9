"""Memory of one training step of the demo GPT: parameters, gradients, optimizer state and the tensors
saved for backward (counted with torch's saved-tensor hooks, each storage once, parameters left out),
and the allocator's peak where the device has one (CUDA), for fp32, bf16 autocast, FP8 per recipe
(operands as the GEMM takes them, then everything saved in FP8) and FP8 with FP8 optimizer states."""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterable

import torch

import fp8train as ft
from fp8train.optim import AdamW, state_bytes
from fp8train.saved import ENV_SAVE_FP8
from fp8train.tools.models import GPT, MODEL_SIZES, next_token_loss

from .common import environment, interleaved_medians

RECIPES = {
    "delayed": ft.DelayedScaling,
    "current": ft.Float8CurrentScaling,
    "block": ft.Float8BlockScaling,
    "mxfp8": ft.MXFP8BlockScaling,
    "nvfp4": ft.NVFP4BlockScaling,
}


def saved_bytes(
    fn: Callable[[], torch.Tensor], exclude: Iterable[torch.Tensor] = ()
) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
    """fn()'s result, the bytes autograd saved for its backward (each storage once, those of `exclude`,
    the parameters, which are held anyway, left out) and one saved tensor per storage counted."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(t.untyped_storage().nbytes() for t in seen.values()), list(seen.values())


@contextlib.contextmanager
def _saving_fp8(on: bool):
    before = os.environ.get(ENV_SAVE_FP8)
    os.environ[ENV_SAVE_FP8] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_SAVE_FP8]
        else:
            os.environ[ENV_SAVE_FP8] = before


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _fp8_meta_bytes(model: torch.nn.Module) -> int:
    """Delayed scaling's amax histories and scales of every FP8 module (the other recipes keep none)."""
    metas = [
        m.fp8_meta[key]
        for m in model.modules()
        if isinstance(m, ft.FP8Module)
        for key in ("scaling_fwd", "scaling_bwd")
    ]
    return sum(_nbytes((meta.amax_history, meta.scale, meta.scale_inv)) for meta in metas if meta is not None)


def measure(
    config: str,
    recipe: str | None,
    save_fp8: bool,
    fp8_states: bool,
    size: str,
    batch: int,
    device: str,
    bf16_params: bool = False,
) -> dict:
    """One training step of a fresh demo GPT (same seed, same tokens) in `config`; `bf16_params`:
    parameters (and so gradients) in bf16, with fp8train.optim.AdamW's bf16 + remainder master."""
    torch.manual_seed(0)
    cfg = MODEL_SIZES[size]
    model = GPT(cfg).to(device, torch.bfloat16 if bf16_params else torch.float32)
    for mlp in (block.mlp for block in model.blocks):
        mlp.save_activation_input_fp8 = save_fp8
    params = list(model.parameters())
    if fp8_states:
        opt = AdamW(params, lr=1e-3, master="bf16" if bf16_params else "fp32")
    else:
        opt = torch.optim.AdamW(params, lr=1e-3)
    tokens = torch.randint(
        0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    tokens = tokens.to(device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    bf16 = config != "fp32"  # FP8 too: its GEMMs' outputs, and the ops between them, in bf16
    with _saving_fp8(save_fp8), torch.autocast(device.split(":")[0], torch.bfloat16, enabled=bf16):
        with ft.fp8_autocast(enabled=recipe is not None, fp8_recipe=RECIPES[recipe]() if recipe else None):
            logits, saved, _ = saved_bytes(lambda: model(tokens[:, :-1]), params)
        next_token_loss(logits, tokens).backward()
    opt.step()
    row = {
        "config": config,
        "params_MB": _nbytes(params) / 1e6,
        "grads_MB": _nbytes(p.grad for p in params if p.grad is not None) / 1e6,
        "optim_state_MB": state_bytes(opt) / 1e6,
        "saved_MB": saved / 1e6,
        "fp8_meta_MB": _fp8_meta_bytes(model) / 1e6,
    }
    row["sum_MB"] = sum(v for k, v in row.items() if k.endswith("_MB"))
    if cuda:
        torch.cuda.synchronize()
        row["allocator_peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 1e6 + row["params_MB"]
    return row


def mlp_block(tokens: int = 512, hidden: int = 256, ffn: int = 1024) -> list[dict]:
    """Bytes saved for backward by one MLP block (LayerNorm, fc1, GELU, fc2) of fp32 inputs: torch in
    fp32 and in bf16 autocast, fp8train.LayerNormMLP per recipe with operands as the GEMM takes them
    and with everything saved in FP8 (FP8TRAIN_SAVE_FP8=1, save_activation_input_fp8=True)."""
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.LayerNorm(hidden),
        torch.nn.Linear(hidden, ffn),
        torch.nn.GELU("tanh"),
        torch.nn.Linear(ffn, hidden),
    )
    rows = []
    for name, bf16 in (("torch fp32", False), ("torch bf16 autocast", True)):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            saved = saved_bytes(lambda: ref(x.clone().requires_grad_()), ref.parameters())[1]
        rows.append({"config": name, "saved_MB": saved / 1e6})
    for recipe, make in RECIPES.items():
        for save_fp8 in (False, True):
            mlp = ft.LayerNormMLP(hidden, ffn, save_activation_input_fp8=save_fp8)
            with _saving_fp8(save_fp8), ft.fp8_autocast(fp8_recipe=make()):
                saved = saved_bytes(lambda: mlp(x.clone().requires_grad_()), mlp.parameters())[1]
            rows.append(
                {"config": f"fp8 {recipe}" + (", saved in fp8" if save_fp8 else ""), "saved_MB": saved / 1e6}
            )
    bf16 = rows[1]["saved_MB"]
    return [{**row, "vs_bf16": row["saved_MB"] / bf16} for row in rows]


def option_cost(
    recipes: Iterable[str], tokens: int = 512, hidden: int = 256, ffn: int = 1024, repeats: int = 7
) -> list[dict]:
    """Forward + backward time of the MLP block with and without everything saved in FP8, run
    round-robin (the cost of the conversions and the decoding, side by side)."""
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
    rows = []
    for recipe in recipes:
        fns = {}
        for save_fp8 in (False, True):
            mlp = ft.LayerNormMLP(hidden, ffn, save_activation_input_fp8=save_fp8)

            def step(mlp=mlp, save_fp8=save_fp8, make=RECIPES[recipe]) -> None:
                with _saving_fp8(save_fp8), ft.fp8_autocast(fp8_recipe=make()):
                    y = mlp(x)
                    y.sum().backward()

            fns["saved in fp8" if save_fp8 else "default"] = step
        ms = {k: v * 1e3 for k, v in interleaved_medians(fns, repeats).items()}
        rows.append(
            {
                "recipe": recipe,
                **{f"{k}_ms": v for k, v in ms.items()},
                "ratio": ms["saved in fp8"] / ms["default"],
            }
        )
    return rows


def run(
    size: str = "small", batch: int = 16, device: str | None = None, recipes: Iterable[str] = tuple(RECIPES)
) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    configs = [("fp32", None, False, False), ("bf16 autocast", None, False, False)]
    for name in recipes:
        configs += [(f"fp8 {name}", name, False, False), (f"fp8 {name}, saved in fp8", name, True, False)]
    configs += [(f"fp8 {name}, saved in fp8, fp8 states", name, True, True) for name in recipes]
    rows = [measure(c, r, s, f, size, batch, device) for c, r, s, f in configs]
    rows += [
        measure(
            f"fp8 {name}, saved in fp8, fp8 states, bf16 params", name, True, True, size, batch, device, True
        )
        for name in recipes
    ]
    bf16 = next(r for r in rows if r["config"] == "bf16 autocast")
    for row in rows:
        row["sum_vs_bf16"] = row["sum_MB"] / bf16["sum_MB"]
        row["saved_vs_bf16"] = row["saved_MB"] / bf16["saved_MB"]
    return {
        "rows": rows,
        "mlp_block": mlp_block(),
        "option_cost": option_cost(recipes, repeats=2 if size == "tiny" else 7),
        "model": size,
        "batch": batch,
        "device": device,
        "goal": "fp8 + fp8 states <= 0.6x bf16 autocast (sum of the step's bytes)",
        "environment": environment(),
    }

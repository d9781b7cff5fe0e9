"""fp8train.optim.AdamW against torch.optim.AdamW: the moments' error per storage choice, bytes per
parameter, the optimizer step's time, and the demo's tiny GPT trained with each (final loss)."""

from __future__ import annotations

import torch

import fp8train as ft
from fp8train.optim import AdamW, bytes_per_parameter, codecs
from fp8train.tools.data import MarkovTask
from fp8train.tools.models import GPT, MODEL_SIZES, next_token_loss

from .common import interleaved_medians

GRADIENTS = {
    "normal": lambda n, g: torch.randn(n, generator=g),
    "heavy-tailed": lambda n, g: (
        torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp_(min=1e-3).sqrt()
    ),
}


def _moments(opt_factory, grads) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.nn.Parameter(torch.zeros(grads[0].shape))
    opt = opt_factory([w])
    for g in grads:
        w.grad = g
        opt.step()
    state = opt.state[w]
    if isinstance(opt, AdamW):
        m = codecs.decode_blocks(state["exp_avg"], state["exp_avg_scale"]).reshape(-1)[: w.numel()]
        return m, opt._decode_second(state).reshape(-1)[: w.numel()]
    return state["exp_avg"], state["exp_avg_sq"]


def moment_errors(elements: int, steps: int) -> list[dict]:
    rows = []
    for name, sample in GRADIENTS.items():
        g = torch.Generator().manual_seed(0)
        grads = [sample(elements, g) for _ in range(steps)]
        ref_m, ref_v = _moments(lambda p: torch.optim.AdamW(p, lr=0.0), grads)
        ref_u = ref_m / (ref_v.sqrt() + 1e-8)
        for second in ("expanded", "sqrt", "linear"):
            for stochastic in (True, False):
                m, v = _moments(
                    lambda p: AdamW(p, lr=0.0, second_moment=second, stochastic=stochastic), grads
                )
                u = m / (v.sqrt() + 1e-8)
                rows.append(
                    {
                        "gradients": name,
                        "second_moment": second,
                        "rounding": "stochastic" if stochastic else "nearest",
                        "m_rel_err": float((m - ref_m).norm() / ref_m.norm()),
                        "v_rel_err": float((v - ref_v).norm() / ref_v.norm()),
                        "v_median_rel_err": float(((v - ref_v).abs() / ref_v).median()),
                        "update_rel_err": float((u - ref_u).norm() / ref_u.norm()),
                    }
                )
    return rows


def tiny_gpt_final_loss(make, steps: int = 150, seed: int = 0, dtype: torch.dtype = torch.float32) -> float:
    """The demo's tiny GPT in FP8 (delayed scaling) trained `steps` steps on the Markov task with the
    optimizer `make(parameters)`: the mean loss of the last 10 steps."""
    cfg = MODEL_SIZES["tiny"]
    batches = MarkovTask(cfg.vocab_size, cfg.seq_len, seed=0).sample(16 * steps, seed=1).view(steps, 16, -1)
    torch.manual_seed(seed)
    model = GPT(cfg).to(dtype)
    opt = make(model.parameters())
    losses = []
    for tokens in batches:
        with ft.fp8_autocast():
            logits = model(tokens[:, :-1])
        loss = next_token_loss(logits, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10


CONFIGS = {  # name: (optimizer factory, parameter dtype, parameter + gradient bytes per element)
    "torch AdamW fp32": (lambda p: torch.optim.AdamW(p, lr=3e-3), torch.float32, 8),
    "torch AdamW bf16 (no master)": (lambda p: torch.optim.AdamW(p, lr=3e-3), torch.bfloat16, 4),
    "fp8 AdamW, fp32 master": (lambda p: AdamW(p, lr=3e-3), torch.float32, 8),
    "fp8 AdamW, bf16 + remainder": (lambda p: AdamW(p, lr=3e-3, master="bf16"), torch.bfloat16, 4),
}


def _state_bytes_per_parameter(opt: torch.optim.Optimizer, model: torch.nn.Module) -> float:
    if isinstance(opt, AdamW):
        return bytes_per_parameter(opt)
    held = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    return held / sum(p.numel() for p in model.parameters())


def run(elements: int = 1 << 14, moment_steps: int = 200, gpt_steps: int = 150, seeds: int = 2) -> dict:
    cfg = MODEL_SIZES["tiny"]
    optimizers, rows = {}, []
    for name, (make, dtype, param_and_grad) in CONFIGS.items():
        model = GPT(cfg).to(dtype)
        opt = make(model.parameters())
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        optimizers[name] = opt
        state = _state_bytes_per_parameter(opt, model)
        total = state + param_and_grad
        rows.append({"optimizer": name, "state_bytes_per_param": state, "total_bytes_per_param": total})
    # every optimizer's step timed round-robin in one loop, so that the machine's load hits all alike
    seconds = interleaved_medians({name: opt.step for name, opt in optimizers.items()}, repeats=20)
    for row in rows:
        make, dtype, _ = CONFIGS[row["optimizer"]]
        row["step_ms"] = 1e3 * seconds[row["optimizer"]]
        row["losses"] = [tiny_gpt_final_loss(make, gpt_steps, seed, dtype) for seed in range(seeds)]
        row["final_loss"] = sum(row["losses"]) / len(row["losses"])
    reference = rows[0]["losses"]
    for row in rows:
        row["gap_pct_per_seed"] = [100 * (a / b - 1) for a, b in zip(row.pop("losses"), reference)]
    return {
        "rows": rows,
        "moment_errors": moment_errors(elements, moment_steps),
        "config": dict(elements=elements, moment_steps=moment_steps, gpt_steps=gpt_steps, seeds=seeds),
    }

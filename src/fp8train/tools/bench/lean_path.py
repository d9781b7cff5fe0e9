"""The eager FP8 step's overhead as counts (issue 37, items 3 and 4): passes over the operands it
casts, aten calls per FP8 GEMM, and fp8train's own Python calls per FP8 GEMM. Counts, not times: the
same on a loaded machine. `tests/recipes/test_lean_path.py` bounds them; `fp8train bench cast` prints them.

- passes: `StepCensus.elements` of one training step (forward + backward, delayed scaling, eager)
  over the elements of the operands cast (each layer's input, weight and output gradient), for the
  FP8 step and for the same step in fp32 (its own non-GEMM ops: activation, loss, gradient sums);
  "extra" is the FP8 step's beyond the fp32 step's.
- aten calls per GEMM: the FP8 step's calls beyond the fp32 step's, over its GEMMs.
- Python calls per GEMM: `PackageCalls` of one step, over its GEMMs, and the marginal figure: the
  calls that `layers` more layers add, over the GEMMs they add (what a larger model pays per GEMM;
  the per-step work, the region's exit and the end of backward, drops out).
"""

from __future__ import annotations

import torch

import fp8train as ft

from .common import PackageCalls, StepCensus, linear_operand_elements


def _stack(linear, widths: list[int]) -> torch.nn.Module:
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [linear(a, b), torch.nn.GELU(approximate="tanh")]
    return torch.nn.Sequential(*layers[:-1])


def _step(model: torch.nn.Module, x: torch.Tensor, recipe):
    def fn() -> None:
        with ft.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = model(x)
        y.float().square().mean().backward()

    return fn


def census(widths=(1024, 4096, 1024), tokens: int = 256, more_layers: int = 4, warmup: int = 2) -> dict:
    """The counts of an MLP of `widths` (hidden, ffn, hidden: an MLP block) on `tokens` tokens."""
    torch.manual_seed(0)
    widths = list(widths)
    fp32, fp8 = _stack(torch.nn.Linear, widths), _stack(ft.Linear, widths)
    fp8.load_state_dict(fp32.state_dict(), strict=False)
    x = torch.randn(tokens, widths[0], requires_grad=True)
    recipe = ft.DelayedScaling(amax_history_len=16)
    steps = {"fp32": _step(fp32, x, None), "fp8": _step(fp8, x, recipe)}
    counts = {}
    for name, fn in steps.items():
        for _ in range(warmup):
            fn()
        with StepCensus() as c:
            fn()
        counts[name] = c
    with PackageCalls() as calls:
        steps["fp8"]()
    cast = linear_operand_elements(fp8, tokens)
    gemms = counts["fp8"].gemms
    deeper = _stack(ft.Linear, widths[:1] * (more_layers + 1) + widths)  # `more_layers` square layers more
    deeper_step = _step(deeper, x, recipe)
    for _ in range(warmup):
        deeper_step()
    with StepCensus() as deeper_census:
        deeper_step()
    with PackageCalls() as deeper_calls:  # not inside the census: its dispatch hook is package code
        deeper_step()
    added_gemms = deeper_census.gemms - gemms
    fp8_c, fp32_c = counts["fp8"], counts["fp32"]
    return {
        "widths": widths,
        "tokens": tokens,
        "cast_elements": cast,
        "fp8_gemms": gemms,
        "passes_per_cast_element": fp8_c.elements / cast,
        "extra_passes_per_cast_element": (fp8_c.elements - fp32_c.elements) / cast,
        "passes_by_op": {k: round(v / cast, 3) for k, v in fp8_c.by_op.most_common() if v >= cast // 100},
        "aten_calls_fp32": fp32_c.calls,
        "aten_calls_fp8": fp8_c.calls,
        "extra_aten_calls_per_gemm": (fp8_c.calls - fp32_c.calls) / gemms,
        "python_calls_per_gemm": calls.calls / gemms,
        "python_calls_per_added_gemm": (deeper_calls.calls - calls.calls) / added_gemms,
        "python_calls_by_function": {f"{k[0]}:{k[1]}": v for k, v in calls.by_function.most_common(25)},
    }


def gpt_census(layers: int = 12, batch: int = 8) -> dict:
    """The demo's tiny GPT (hidden 64, ffn 256; `layers` blocks, `batch` sequences of its 32 tokens:
    operands of 4K-64K elements, where the casts' and outputs' calls, not their passes, cost): aten
    calls per FP8 GEMM beyond the fp32 step's (`per_op`: by op, over the GEMMs) and fp8train's Python
    calls per FP8 GEMM, one step (delayed scaling, eager, forward + backward)."""
    import collections
    import dataclasses

    from ..models import GPT, MODEL_SIZES

    torch.manual_seed(0)
    cfg = dataclasses.replace(MODEL_SIZES["tiny"], layers=layers)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
    recipe = ft.DelayedScaling(amax_history_len=16)

    def step(fp8: bool) -> None:
        with ft.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            loss = model.loss(tokens)
        loss.backward()

    counts = {}
    for fp8 in (False, True):
        step(fp8)
        with StepCensus() as counts[fp8]:
            step(fp8)
    with PackageCalls() as calls:
        step(True)
    gemms = counts[True].gemms
    extra = collections.Counter(counts[True].ops)
    extra.subtract(counts[False].ops)
    return {
        "layers": layers,
        "fp8_gemms": gemms,
        "extra_aten_calls_per_gemm": (counts[True].calls - counts[False].calls) / gemms,
        "python_calls_per_gemm": calls.calls / gemms,
        "per_op": {k: round(v / gemms, 2) for k, v in extra.most_common() if abs(v) >= gemms // 10},
    }


def rows(result: dict) -> list[dict]:
    """The census as table rows."""
    return [
        {"count": "passes per cast-operand element (FP8 step, non-GEMM ops)",
         "value": result["passes_per_cast_element"]},
        {"count": "  of which beyond the fp32 step's", "value": result["extra_passes_per_cast_element"]},
        {"count": "aten calls per FP8 GEMM beyond the fp32 step's",
         "value": result["extra_aten_calls_per_gemm"]},
        {"count": "fp8train Python calls per FP8 GEMM (one step)", "value": result["python_calls_per_gemm"]},
        {"count": "fp8train Python calls per FP8 GEMM a deeper model adds",
         "value": result["python_calls_per_added_gemm"]},
    ]  # fmt: skip

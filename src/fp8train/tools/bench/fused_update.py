"""Cost of the per-step scaling update for 4, 64 and 512 FP8 modules: fused vs a per-module loop."""

from __future__ import annotations

import torch

import fp8train as ft
from fp8train.amax import update_scaling

from .common import OpCounter, interleaved_medians


def _model(n_modules: int, history_len: int) -> tuple[torch.nn.Module, object]:
    ft.inspection.reset()  # a fresh amax group holding exactly these modules
    model = torch.nn.Sequential(*[ft.Linear(16, 16) for _ in range(n_modules)])
    recipe = ft.DelayedScaling(amax_history_len=history_len)
    with ft.fp8_autocast(fp8_recipe=recipe):
        model(torch.randn(4, 16))  # registers every module (no grad needed for that under autocast)
    ft.synchronize()
    return model, model[0].fp8_meta["scaling_fwd"].direction


def run(module_counts=(4, 64, 512), history_len: int = 1024, repeats: int = 30) -> dict:
    rows = []
    for n in module_counts:
        model, direction = _model(n, history_len)
        storage = direction.storage
        amaxes = torch.rand(storage.num_roles)

        def fused():
            storage.recording.copy_(amaxes)
            direction.record(0, amaxes[0])  # one recorded role: what a training call leaves
            direction.launch(async_op=True, region_index=0)
            direction.finish()

        def per_module():  # what a library without contiguous storage does: one update per module
            for m in model:
                meta = m.fp8_meta["scaling_fwd"]
                cols = slice(meta.offset, meta.offset + meta.num_roles)
                update_scaling(
                    storage.history[:, cols],
                    storage.scale[cols],
                    storage.scale_inv[cols],
                    amaxes[cols],
                    direction.recipe,
                    direction.fp8_max,
                )

        with OpCounter() as fused_ops:
            fused()
        with OpCounter() as loop_ops:
            per_module()
        times = interleaved_medians({"fused": fused, "per_module": per_module}, repeats)
        rows.append(
            {
                "modules": n,
                "roles": storage.num_roles,
                "fused_ops": fused_ops.count,
                "fused_ms": 1e3 * times["fused"],
                "per_module_ops": loop_ops.count,
                "per_module_ms": 1e3 * times["per_module"],
            }
        )
    return {"history_len": history_len, "rows": rows}

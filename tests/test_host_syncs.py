"""Zero host synchronisations in a steady training step (issue 10), counted on the CPU.

`host_reads.HostReadCounter` counts every host read of a tensor value (`.item()`, `.tolist()`,
`bool`, `float`, `int`, `.cpu()`, ...) and every on-the-spot host-to-device tensor creation that
fp8train's own code makes: on a GPU each of them would stall the host until the stream drains, and
an asynchronous amax reduction followed by one would be a blocking one. The GPU check
(scripts/gpu_check.sh) runs the same steps under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import os

import pytest
import torch

import fp8train
from fp8train.header import HEADER_LEN, Header
from fp8train.scaling import ScalingStorage
from fp8train.telemetry import Telemetry
from fp8train.tools.ranks import run_ranks
from host_reads import HostReadCounter

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"  # the documented variable (README)

RECIPE = fp8train.DelayedScaling(amax_history_len=4)
WARMUP, STEADY = 3, 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        fp8train.LayerNormLinear(32, 32),
        torch.nn.GELU(),
        fp8train.LayerNormMLP(32, 64),
        fp8train.Linear(32, 32),
    )


def _steady_steps(rank: int, world: int, gemm: str, mode: str, telemetry: bool) -> dict:
    """WARMUP steps, then STEADY counted ones: the reads, and whether the storage stayed in place."""
    os.environ["FP8TRAIN_GEMM"] = gemm
    os.environ[ENV_ASYNC] = "1" if mode == "async" else "0"
    fp8train.inspection.reset()
    model = _model()
    tel = Telemetry(model) if telemetry else None

    def step(i: int) -> None:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * rank + i))
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            y = model(x)
        loss = y.square().mean()
        loss.backward()
        with torch.no_grad():  # evaluation in the step too: it must not read either
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                model(x)
        for p in model.parameters():
            p.grad = None
        if tel is not None:
            tel.log_step(i, loss=loss.detach())

    def storage_pointers() -> list[int]:
        storages = [d.storage for g in fp8train.inspection.amax_groups() for d in (g.fwd, g.bwd)]
        return [
            t.data_ptr() for s in storages for t in (s.history, s.scale, s.scale_inv, s.recording, s.digest)
        ]

    for i in range(WARMUP):
        step(i)
    before = storage_pointers()
    with HostReadCounter() as reads:
        for i in range(WARMUP, WARMUP + STEADY):
            step(i)
    stats = fp8train.reduction_stats()  # a host point, after the counted steps
    return {"reads": reads.sites, "moved": storage_pointers() != before, "launched": stats["launched"]}


CONFIGS = [(gemm, mode) for gemm in ("scaled_mm", "bf16") for mode in ("async", "blocking")]


@pytest.mark.parametrize("gemm,mode", CONFIGS)
def test_one_process_steady_steps_read_nothing(gemm: str, mode: str, monkeypatch) -> None:
    monkeypatch.setenv("FP8TRAIN_GEMM", gemm)  # restored after the test (the worker sets it too)
    monkeypatch.setenv(ENV_ASYNC, "1")
    out = _steady_steps(0, 1, gemm, mode, telemetry=True)
    assert out["reads"] == []
    assert not out["moved"]  # no storage growth in steady steps: what a CUDA graph capture needs


def _all_configs(rank: int, world: int) -> dict:
    return {f"{g} {m} {t}": _steady_steps(rank, world, g, m, t) for g, m in CONFIGS for t in (False, True)}


@pytest.mark.multirank
def test_two_ranks_steady_steps_read_nothing() -> None:
    for out in run_ranks(_all_configs, 2, timeout_s=240, pg_timeout_s=60):
        for config, result in out.items():
            assert result["reads"] == [], config
            assert not result["moved"], config
            assert result["launched"] > 0, config  # the reductions really ran


def test_the_counter_sees_reads_in_the_package() -> None:
    """The counter can fail: `state_dict()` is a host point that copies the FP8 state to the host, and
    every one of its reads is seen (and attributed to the package's line that made it)."""
    model = _model()
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        model(torch.randn(16, 32)).sum().backward()
    with HostReadCounter() as reads:
        model.state_dict()
    assert len(reads.sites) == 3 * 2 * 3  # amax_history, scale, scale_inv x 2 directions x 3 modules
    assert all(site.startswith("cpu at modules/scaling_meta.py") for site in reads.sites)
    with HostReadCounter() as reads:
        torch.zeros(3).tolist()  # a read outside the package is not fp8train's
    assert reads.sites == []


def test_header_is_written_on_the_device() -> None:
    """A steady launch builds its header from cached device values: no tensor from host data."""
    storage = ScalingStorage(4, torch.device("cpu"))
    storage.append(torch.zeros(4, 3), torch.ones(3), torch.ones(3))
    writer = Header("fwd", RECIPE.key())
    writer.add_member("Linear(16x16)")
    writer.write(storage, 1, (0, 1), 5, 3)  # the first call with these recorded roles caches the static part
    with HostReadCounter() as reads:
        header = writer.write(storage, 1, (0, 1), 6, 3)
    assert reads.sites == [] and header.shape == (HEADER_LEN,)
    assert header[10].item() == 6 and header[11].item() == -6  # the training-region index, (q, -q)

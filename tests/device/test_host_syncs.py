"""Zero host synchronisations in a steady training step, counted on the CPU.

`HostSyncCounter` (fp8train.tools.host_syncs) counts what fp8train's own code does that would make a
GPU host wait: every host read of a tensor value (`.item()`, `.tolist()`, `bool`, `float`, `int`,
`.cpu()`, ...), every tensor made from host data (`aten.lift_fresh`, `torch.tensor(device=...)`),
every Python number written into one element of a tensor, and every host tensor moved onto the
device. On a GPU each of them would stall the host until the stream drains, and an asynchronous
amax reduction followed by one would be a blocking one. The one site allowed is
`host_syncs.HOST_RESIDENT`: the region token, a host tensor by design (counted apart, and seen: the
counter watched the steps). The GPU check (scripts/gpu_check.sh) counts with the same counter and
runs the same steps under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import os

import pytest
import torch

import fp8train
from fp8train.amax.header import HEADER_LEN, Header
from fp8train.amax.storage import ScalingStorage
from fp8train.telemetry import Telemetry
from fp8train.tensor_stats import GemmStatistics
from fp8train.tools.host_syncs import PACKAGE_DIR, HostSyncCounter
from multirank import run_ranks

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"  # the documented variable (README)

RECIPE = fp8train.DelayedScaling(amax_history_len=4)
RECIPES = {
    "delayed": RECIPE,
    "current": fp8train.Float8CurrentScaling(),
    "block": fp8train.Float8BlockScaling(),
    "mxfp8": fp8train.MXFP8BlockScaling(),
    "nvfp4": fp8train.NVFP4BlockScaling(),
}
WARMUP, STEADY = 3, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        fp8train.LayerNormLinear(32, 32),
        torch.nn.GELU(),
        fp8train.LayerNormMLP(32, 64),
        fp8train.Linear(32, 32),
    )


def _steady_steps(
    rank: int, world: int, recipe: str, gemm: str, mode: str, telemetry: bool, statistics: bool = False
) -> dict:
    """WARMUP steps, then STEADY counted ones: the sites, and whether the storage stayed in place."""
    os.environ["FP8TRAIN_GEMM"] = gemm
    os.environ[ENV_ASYNC] = "1" if mode == "async" else "0"
    fp8train.inspection.reset()
    model = _model()
    what_if = fp8train.Float8CurrentScaling()
    stats = GemmStatistics(model, what_if=what_if) if statistics else None  # every step measured
    tel = Telemetry(model, statistics=stats) if telemetry else None
    fp8_recipe = RECIPES[recipe]

    def step(i: int) -> None:
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(100 * rank + i))
        with fp8train.fp8_autocast(fp8_recipe=fp8_recipe):
            y = model(x)
        loss = y.square().mean()
        loss.backward()
        with torch.no_grad():  # evaluation in the step too: it must not read either
            with fp8train.fp8_autocast(fp8_recipe=fp8_recipe):
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
    with HostSyncCounter() as counted:
        for i in range(WARMUP, WARMUP + STEADY):
            step(i)
    stats = fp8train.reduction_stats()  # a host point, after the counted steps
    return {
        "sites": counted.sites,
        "host_resident": len(counted.host_resident),  # host_syncs.HOST_RESIDENT: the region token
        "moved": storage_pointers() != before,
        "launched": stats["launched"],
    }


MODES = ("async", "blocking")
# Every recipe on the hardware GEMM path (emulated where the CPU lacks it); delayed scaling on the
# bf16 path too. Two ranks run each in both modes, with and without telemetry; one process (no
# reduction: its code paths differ) runs each recipe asynchronous without telemetry, and blocking with.
PATHS = [(recipe, "scaled_mm") for recipe in RECIPES] + [("delayed", "bf16")]
CONFIGS = [(recipe, gemm, mode) for recipe, gemm in PATHS for mode in MODES]


@pytest.mark.parametrize("recipe,gemm", PATHS)
def test_one_process_steady_steps_make_no_host_sync(recipe: str, gemm: str, monkeypatch) -> None:
    monkeypatch.setenv("FP8TRAIN_GEMM", gemm)  # restored after the test (the worker sets it too)
    monkeypatch.setenv(ENV_ASYNC, "1")
    for mode, telemetry in (("async", False), ("blocking", True)):
        out = _steady_steps(0, 1, recipe, gemm, mode, telemetry)
        assert out["sites"] == [], mode
        assert out["host_resident"] > 0 or recipe != "delayed"  # its tokens: the counter was watching
        assert not out["moved"]  # no storage growth in steady steps: what a CUDA graph capture needs


@pytest.mark.parametrize("recipe", ["delayed", "block", "nvfp4"])  # mxfp8 needs 32 tokens
def test_tensor_statistics_and_step_coverage_make_no_host_sync(recipe: str, monkeypatch) -> None:
    monkeypatch.setenv("FP8TRAIN_GEMM", "scaled_mm")
    monkeypatch.setenv(ENV_ASYNC, "1")
    out = _steady_steps(0, 1, recipe, "scaled_mm", "async", telemetry=True, statistics=True)
    assert out["sites"] == []


def _all_configs(rank: int, world: int) -> dict:
    return {f"{c} {t}": _steady_steps(rank, world, *c, t) for c in CONFIGS for t in (False, True)}


@pytest.mark.multirank
def test_two_ranks_steady_steps_make_no_host_sync() -> None:
    for out in run_ranks(_all_configs, 2, timeout_s=400, pg_timeout_s=120):
        for config, result in out.items():
            assert result["sites"] == [], config
            assert not result["moved"], config
            if config.startswith("delayed"):
                assert result["launched"] > 0, config  # the reductions really ran
                assert result["host_resident"] > 0, config  # and the counter was watching them


def test_the_counter_sees_reads_in_the_package() -> None:
    """The counter can fail: `state_dict()` is a host point that copies the FP8 state to the host, and
    every one of its reads is seen (and attributed to the package's line that made it)."""
    model = _model()
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        model(torch.randn(16, 32)).sum().backward()
    with HostSyncCounter() as reads:
        model.state_dict()
    assert len(reads.sites) == 3 * 2 * 3  # amax_history, scale, scale_inv x 2 directions x 3 modules
    assert all(site.startswith("cpu at amax/meta.py") for site in reads.sites)
    with HostSyncCounter() as reads:
        torch.zeros(3).tolist()  # a read outside the package is not fp8train's
    assert reads.sites == []


def test_header_is_written_on_the_device() -> None:
    """A steady launch builds its header from cached device values: no tensor from host data."""
    storage = ScalingStorage(4, torch.device("cpu"))
    storage.append(torch.zeros(4, 3), torch.ones(3), torch.ones(3))
    writer = Header("fwd", RECIPE.key())
    writer.add_member("Linear(16x16)")
    writer.write(storage, 1, (0, 1), 5, 3)  # the first call with these recorded roles caches the static part
    with HostSyncCounter() as reads:
        header = writer.write(storage, 1, (0, 1), 6, 3)
    assert reads.sites == [] and header.shape == (HEADER_LEN,)
    assert header[10].item() == 6 and header[11].item() == -6  # the training-region index, (q, -q)
    assert header[12].item() == 3 and header[13].item() == -3  # the values sent after the header


def _run_as_package_code(source: str, device: str = "cpu", **names) -> list[str]:
    """Run `source` as if it were a line of fp8train (its frames name a file in the package) under the
    counter watching `device`; the sites it counted."""
    code = compile(source, os.path.join(PACKAGE_DIR, "probe.py"), "exec")
    with HostSyncCounter(device) as counted:
        exec(code, {"torch": torch, **names})
    return counted.sites


def test_the_counter_sees_tensors_made_from_host_data() -> None:
    """Each way of making a device tensor from host data is seen, in package code; the device-side
    ways of doing the same are not."""
    device = torch.zeros(4)  # stands for a device tensor
    seen = {
        "torch.tensor([1.0, 2.0])": "lift_fresh",
        "torch.as_tensor(2.0)": "lift_fresh",
        "d[1] = 5": "__setitem__ of a Python number",
        "d[0, ] = 5.0": "__setitem__ of a Python number",
        "d.copy_(torch.zeros(4))": "copy_ of a host tensor",  # a factory without device=
        "(torch.ones(2, 2) * 2).t().to(d.device)": "to of a host tensor",  # computed from host tensors
        "torch.arange(4).to(d)": "to of a host tensor",
        "table.to(d.device)": "to of a host tensor",  # a module-level constant of the package
    }
    from fp8train.numerics.microscaling import _E2M1_TABLE

    for source, what in seen.items():
        sites = _run_as_package_code(source, d=device.clone(), table=_E2M1_TABLE)
        assert any(s.startswith(what) for s in sites), (source, sites)
        assert all(s.endswith(" at probe.py:1 (<module>)") for s in sites), sites
    unseen = [
        "d[:1].fill_(5.0)",
        "torch.full((2,), 3.0, device=d.device)",
        "d.to(torch.float64)",
        "torch.where(d > 0, 1.0, d) * 2.0",
        "torch.zeros(2).to(torch.int64)",  # a host tensor that stays on the host
    ]
    for source in unseen:
        assert _run_as_package_code(source, d=device.clone()) == [], source
    assert HostSyncCounter().sites == [] and _run_as_package_code("pass") == []


def test_watching_another_device_the_counter_sees_real_copies_onto_it_and_reads_of_its_tensors() -> None:
    """The GPU check's view (the counter watching a GPU; the meta device stands in for it): a real copy
    from the CPU onto the device is seen once, as what it is; a read of a CPU tensor is not (it waits
    for no device), a read of a device tensor is."""
    site = " at probe.py:1 (<module>)"
    copy = "host-to-device copy" + site
    assert _run_as_package_code("torch.zeros(4).to('meta')", "meta") == [copy]
    assert _run_as_package_code("d.copy_(torch.ones(4))", "meta", d=torch.empty(4, device="meta")) == [copy]
    assert _run_as_package_code("torch.ones(2).tolist()", "meta") == []
    assert _run_as_package_code("torch.ones(2).tolist()") == ["tolist" + site]
    read = "try:\n    d.cpu()\nexcept NotImplementedError:\n    pass"  # a meta tensor has no data to read
    assert _run_as_package_code(read, "meta", d=torch.empty(2, device="meta")) == [
        "cpu at probe.py:2 (<module>)"
    ]


def test_the_report_names_each_site_once_with_its_count_and_call_stack() -> None:
    """What the GPU check prints: each site once, how often, and the fp8train frames that led there
    (innermost first, up to the first caller outside the package)."""
    code = compile("for _ in range(3):\n    d.tolist()", os.path.join(PACKAGE_DIR, "probe.py"), "exec")
    with HostSyncCounter() as counted:
        exec(code, {"d": torch.zeros(2)})
    report = counted.report()
    assert list(report) == ["tolist at probe.py:2 (<module>)"] and len(counted.sites) == 3
    entry = report["tolist at probe.py:2 (<module>)"]
    assert entry["count"] == 3 and entry["traceback"][0] == "probe.py:2 in <module>"
    assert entry["traceback"][-1].startswith("test_host_syncs.py:"), entry["traceback"]

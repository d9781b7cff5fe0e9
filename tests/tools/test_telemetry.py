"""Telemetry values against the modules' own fp8_meta, forced overflow, NaN, files and ranks.

`log_step` reads device values through a non-blocking copy and so returns the previous logged
step's record (`flush` completes the last one); it makes no host read of a device value."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

import fp8train
from fp8train.telemetry import Telemetry, read_metrics, role_names
from fp8train.tools.models import GPT, GPTConfig
from multirank import run_ranks

CFG = GPTConfig(vocab_size=32, seq_len=16, hidden=32, heads=2, layers=2, ffn=64)
RECIPE = fp8train.DelayedScaling(amax_history_len=4)


def _train_step(model, tokens, opt=None):
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        loss = model.loss(tokens)
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def _expected(model) -> dict:
    """{role name: (meta, column)} from the modules' GEMM names, independently of telemetry's map."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, fp8train.FP8Module):
            for g in range(module.num_gemms):
                gemm = f"{module.gemm_names[g]}/" if module.num_gemms > 1 else ""
                out[f"{name}/{gemm}input"] = (module.fp8_meta["scaling_fwd"], 3 * g)
                out[f"{name}/{gemm}weight"] = (module.fp8_meta["scaling_fwd"], 3 * g + 1)
                out[f"{name}/{gemm}grad_output"] = (module.fp8_meta["scaling_bwd"], 2 * g)
    return out


def _scales(model) -> dict:
    return {n: float(meta.scale[c]) for n, (meta, c) in _expected(model).items()}


def _logged(tel: Telemetry, step: int, **kwargs) -> dict:
    """Log `step` and return its own record (waiting for it: tests only)."""
    tel.log_step(step, **kwargs)
    return tel.flush()


def test_role_names_of_the_small_gpt():
    names = {n for n, *_ in role_names(GPT(CFG))}
    assert len(names) == 2 * 4 * 3  # layers x GEMMs x (input, weight, grad_output)
    assert names == set(_expected(GPT(CFG)))
    assert {"blocks.0.mlp/fc1/input", "blocks.1.attn.qkv/grad_output", "blocks.0.attn.proj/weight"} <= names


class TwoGemms(fp8train.FP8Module):
    """A module of this test's own with two GEMMs: its roles get names of their own."""

    num_gemms = 2
    gemm_names = ("up", "down")

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(32, 16) * 0.1)
        self.down = torch.nn.Parameter(torch.randn(16, 32) * 0.1)

    def forward(self, x):
        from fp8train.modules.fp8_linear import fp8_linear

        return fp8_linear(self, fp8_linear(self, x, self.up, None, 0), self.down, None, 1)


def test_every_gemm_of_a_module_gets_its_own_role_names():
    model = torch.nn.Sequential(TwoGemms(), fp8train.Linear(16, 16))
    names = [n for n, *_ in role_names(model)]
    assert len(names) == len(set(names)) == 2 * 3 + 3
    assert {"0/up/input", "0/down/weight", "0/down/grad_output", "1/grad_output"} <= set(names)
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        model(torch.randn(8, 16)).sum().backward()
    rec = _logged(Telemetry(model), 0)
    assert rec["roles"]["0/up/input"]["amax"] != rec["roles"]["0/down/input"]["amax"]


def test_values_match_fp8_meta(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(CFG.vocab_size, (4, CFG.seq_len + 1))
    expected = _expected(model)
    scale_before = {n: 1.0 for n in expected}  # modules start with scale 1
    records, truth = [], []
    with Telemetry(model, str(tmp_path)) as tel:
        for step in range(4):
            loss = _train_step(model, tokens[:, torch.randperm(CFG.seq_len + 1)], opt)
            returned = tel.log_step(step, loss=torch.tensor(loss))  # a tensor loss travels in the copy
            assert (returned is None) == (step == 0)  # one step late
            records += [returned] if returned else []
            # what the modules hold now (reading fp8_meta completes what the telemetry completed)
            now = {n: (float(m.amax_history[0, c]), float(m.scale[c])) for n, (m, c) in expected.items()}
            truth.append((now, dict(scale_before), loss, fp8train.reduction_stats(complete=False)))
            scale_before = _scales(model)
        records.append(tel.flush())
    for step, (rec, (now, used, loss, stats)) in enumerate(zip(records, truth)):
        assert rec["step"] == step and set(rec["roles"]) == set(expected)
        for name, (amax, scale) in now.items():
            got = rec["roles"][name]
            assert got["amax"] == amax and amax > 0, name
            assert got["scale"] == scale, name
            assert got["scale_used"] == used[name], name
            product = torch.tensor(amax) * torch.tensor(used[name])
            fp8_max = 448.0 if name.endswith(("input", "weight")) else 57344.0
            assert got["util"] == pytest.approx(float(product) / fp8_max, rel=1e-6), name
            assert got["overflow"] == bool(product > fp8_max), name
            assert got["nonfinite"] is False
        assert rec["events"]["overflow"] == sum(v["overflow"] for v in rec["roles"].values())
        assert rec["loss"] == loss
        assert (
            rec["reduction"]["updates"] == stats["updates"]
            and rec["reduction"]["launched"] == stats["launched"]
        )
        if step > 0:  # the scales moved: the test really distinguishes scale from scale_used
            assert any(v["scale"] != v["scale_used"] for v in rec["roles"].values())
    lines = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    assert lines[-1]["roles"] == records[-1]["roles"]


def test_log_step_reads_nothing_from_the_device_in_steady_steps():
    from fp8train.tools.host_syncs import HostSyncCounter

    torch.manual_seed(4)
    model = GPT(CFG)
    tokens = torch.randint(CFG.vocab_size, (4, CFG.seq_len + 1))
    tel = Telemetry(model)
    for step in range(2):
        _train_step(model, tokens)
        tel.log_step(step)
    with HostSyncCounter() as reads:
        for step in range(2, 5):
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                loss = model.loss(tokens)
            loss.backward()
            tel.log_step(step, loss=loss.detach())
    assert reads.sites == []
    assert tel.flush()["step"] == 4


def test_scale_used_survives_an_earlier_reader():
    """If something (a checkpoint, a user) reads fp8_meta before log_step, scale_used stays right."""
    torch.manual_seed(1)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(CFG.vocab_size, (4, CFG.seq_len + 1))
    tel = Telemetry(model)
    _train_step(model, tokens, opt)
    _logged(tel, 0)
    for step in range(1, 3):
        before = _scales(model)
        _train_step(model, tokens, opt)
        model.state_dict()  # completes the in-flight reductions before the telemetry does
        rec = _logged(tel, step)
        assert {n: v["scale_used"] for n, v in rec["roles"].items()} == before
        assert {n: v["scale"] for n, v in rec["roles"].items()} == _scales(model)


def test_forced_large_scale_counts_an_overflow():
    torch.manual_seed(2)
    model = GPT(CFG)
    tokens = torch.randint(CFG.vocab_size, (4, CFG.seq_len + 1))
    tel = Telemetry(model)
    _train_step(model, tokens)
    first = _logged(tel, 0)
    assert not first["roles"]["blocks.0.attn.qkv/input"]["overflow"]
    meta = model.blocks[0].attn.qkv.fp8_meta["scaling_fwd"]
    meta.scale[0] = 1e6  # the storage itself: the next step casts the qkv input with this scale
    before = _scales(model)
    _train_step(model, tokens)
    rec = _logged(tel, 1)
    role = rec["roles"]["blocks.0.attn.qkv/input"]
    assert role["scale_used"] == 1e6
    assert role["overflow"] is True and role["util"] > 100
    assert role["util"] == pytest.approx(float(meta.amax_history[0, 0]) * 1e6 / 448, rel=1e-6)
    flagged = {n for n, v in rec["roles"].items() if v["overflow"]}
    expected = {n for n, (m, c) in _expected(model).items() if
                torch.tensor(float(m.amax_history[0, c])) * torch.tensor(before[n])
                > (448.0 if not n.endswith("grad_output") else 57344.0)}  # fmt: skip
    assert "blocks.0.attn.qkv/input" in flagged and flagged == expected
    assert rec["events"]["overflow"] == len(flagged)
    assert tel.totals["overflow"] == first["events"]["overflow"] + len(flagged)


def test_nan_input_counts_nonfinite_and_keeps_the_scale(tmp_path):
    torch.manual_seed(3)
    model = torch.nn.Sequential(fp8train.LayerNormLinear(32, 32), fp8train.Linear(32, 32))
    x = torch.randn(16, 32)
    tel = Telemetry(model, str(tmp_path))
    for step, bad in enumerate((False, True)):
        inp = x.clone()
        if bad:
            inp[3, 5] = float("nan")
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            y = model(inp)
        y.float().sum().backward()
        rec = _logged(tel, step)
    role = rec["roles"]["0/input"]
    assert role["nonfinite"] is True and role["amax"] == "inf"
    assert role["overflow"] is False  # a non-finite amax is its own event, not an overflow
    assert role["scale"] == role["scale_used"]  # the old scale is kept
    assert rec["events"]["nonfinite"] >= 1
    assert rec["reduction_delta"]["nonfinite_amax_events"] >= 1
    assert rec["roles"]["1/weight"]["nonfinite"] is False
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        raw = [json.loads(line) for line in f]  # strict JSON: no bare NaN/Infinity
    assert raw[1]["roles"]["0/input"]["amax"] == "inf"
    assert math.isinf(read_metrics(os.path.join(tmp_path, "metrics.jsonl"))[1]["roles"]["0/input"]["amax"])


def test_every_n_steps_and_extra_fields(tmp_path):
    model = torch.nn.Sequential(fp8train.Linear(16, 16))
    with Telemetry(model, str(tmp_path), every=3, run="r") as tel:
        for step in range(7):
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                model(torch.randn(16, 16)).sum().backward()
            rec = tel.log_step(step, loss=float(step), lr=0.5)
            assert rec is None if step % 3 or step == 0 else rec["step"] == step - 3  # one logged step late
    recs = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [(r["step"], r["run"], r["lr"], r["loss"]) for r in recs] == [
        (s, "r", 0.5, float(s)) for s in (0, 3, 6)
    ]
    # the delta of the reduction statistics covers all the steps since the previous logged one
    assert sum(r["reduction_delta"]["updates"] for r in recs) == recs[-1]["reduction"]["updates"] > 0
    with pytest.raises(ValueError, match="every"):
        Telemetry(model, every=0)


@pytest.mark.parametrize("recipe", [RECIPE, fp8train.Float8CurrentScaling(), fp8train.Float8BlockScaling()])
def test_records_name_the_recipe_and_the_report_reads_it(tmp_path, recipe):
    """A run logged by a plain loop (no demo metadata) is reported under its recipe kind."""
    from fp8train.quantization import recipe_kind
    from fp8train.tools.report import load_run

    model = torch.nn.Sequential(fp8train.Linear(16, 16))
    with Telemetry(model, str(tmp_path), run="r") as tel:
        tel.log_step(0, loss=1.0)  # before any FP8 training: no recipe yet
        for step in range(1, 3):
            with fp8train.fp8_autocast(fp8_recipe=recipe):
                model(torch.randn(16, 16)).sum().backward()
            tel.log_step(step, loss=1.0)
    recs = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["recipe"] for r in recs] == [None] + [recipe_kind(recipe)] * 2
    run = load_run(str(tmp_path))["r"]
    assert run.fp8 and run.recipe_kind == recipe_kind(recipe)


def test_tensorboard_missing_is_reported_not_fatal(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    model = torch.nn.Sequential(fp8train.Linear(16, 16))
    with Telemetry(model, str(tmp_path), tensorboard=True) as tel:
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            model(torch.randn(16, 16)).sum().backward()
        tel.log_step(0, loss=1.0)
    assert "tensorboard" in capsys.readouterr().err.lower()
    assert len(read_metrics(os.path.join(tmp_path, "metrics.jsonl"))) == 1


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("tensorboard") is None, reason="tensorboard is not installed"
)
def test_tensorboard_events_written(tmp_path):
    model = torch.nn.Sequential(fp8train.Linear(16, 16))
    with Telemetry(model, str(tmp_path), tensorboard=True, run="x") as tel:
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            model(torch.randn(16, 16)).sum().backward()
        tel.log_step(0, loss=1.0)
    files = os.listdir(os.path.join(tmp_path, "tensorboard", "x"))
    assert any(f.startswith("events.out.tfevents") for f in files)


def _ranks_fn(rank, world_size):
    torch.manual_seed(0)
    model = GPT(CFG)
    tel = Telemetry(model)
    out = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)  # every rank its own data
        tokens = torch.randint(CFG.vocab_size, (2, CFG.seq_len + 1), generator=g)
        _train_step(model, tokens)
        rec = _logged(tel, step)
        meta = model.blocks[0].mlp.fp8_meta["scaling_fwd"]
        out.append((rec["roles"], float(meta.amax_history[0, 0]), float(meta.scale[0])))
    return out


@pytest.mark.multirank
def test_two_ranks_log_the_same_reduced_values():
    r0, r1 = run_ranks(_ranks_fn, 2, timeout_s=90)
    for (roles0, amax0, scale0), (roles1, amax1, scale1) in zip(r0, r1):
        assert roles0 == roles1  # reduced amaxes and scales: identical on every rank
        assert roles0["blocks.0.mlp/fc1/input"]["amax"] == amax0 == amax1
        assert roles0["blocks.0.mlp/fc1/input"]["scale"] == scale0 == scale1

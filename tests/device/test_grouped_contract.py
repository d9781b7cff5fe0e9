"""Grouped FP8 GEMMs through torch._scaled_grouped_mm keep its CUDA contract and compute what one GEMM
per group computes (docs/design.md, section 9.2, "Native grouped GEMMs").

The CPU has no kernel of `aten::_scaled_grouped_mm`: tests/cuda_contract.py registers one, the checker of
the CUDA kernel's rules (layouts, offsets, scale shapes), which computes each group's product as the
`_scaled_mm` checker computes one GEMM's. With FP8TRAIN_GEMM=scaled_mm both checkers stand in for the
GPU's kernels, so the grouped branch runs on every CPU run:

- bit for bit equal to one torch._scaled_mm per group (FP8TRAIN_GROUPED_GEMM=off) where the groups are
  whole 16 rows (the per-group path takes torch._scaled_mm there): forward, dgrad, wgrad, under delayed and
  current scaling, E4M3 (all three grouped) and HYBRID (E5M2 gradients: forward grouped, backward per group);
- groups off 16 rows are padded inside (the checker refuses unpadded groups): equal bit for bit to the
  same call on explicitly padded groups;
- against the CPU's default emulation (the bf16 path): within two bf16 ulps (the emulation rounds each
  group's unscaled product to bf16 and scales it, the kernel scales and rounds once) plus fp32
  accumulation's gamma_K;
- empty groups: the checker leaves their weight gradient NaN, fp8train sets it to 0;
- MXFP8 (E8M0 scales per 32, each group's in the blocked layout on its own): forward and dgrad grouped
  (wgrad one MX torch._scaled_mm per expert), bit for bit equal to one MX torch._scaled_mm per expert,
  with an empty group and groups off 128 rows; on compute capability 10.x only.
"""

from __future__ import annotations

import pytest
import torch

import fp8train
from cuda_contract import cuda_contract, cuda_grouped_contract, relative_bound
from fp8train import torch_internals
from fp8train.layer_coverage import StepCoverage
from fp8train.modules import grouped_gemm
from fp8train.modules.grouped_gemm import grouped_kernel_choice

E4M3, HYBRID = fp8train.Format.E4M3, fp8train.Format.HYBRID
RECIPES = {
    "delayed_e4m3": lambda: fp8train.DelayedScaling(fp8_format=E4M3, amax_history_len=4),
    "delayed_hybrid": lambda: fp8train.DelayedScaling(fp8_format=HYBRID, amax_history_len=4),
    "current_e4m3": lambda: fp8train.Float8CurrentScaling(fp8_format=E4M3),
    "current_hybrid": lambda: fp8train.Float8CurrentScaling(fp8_format=HYBRID),
}
ALIGNED = [16, 0, 48, 32]  # an empty expert; every group whole 16 rows
OFF_16 = [10, 0, 45, 25]
MX_SPLITS = [32, 0, 160, 96]  # MXFP8 takes whole 32s of tokens; an empty expert; groups off 128 rows
PROBE_OFFS = ("[16, 32])", "[32, 64])")  # the probes' calls (row-wise, MX)


@pytest.fixture(autouse=True)
def _scaled_mm_forced(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("FP8TRAIN_GEMM", "scaled_mm")
    monkeypatch.delenv("FP8TRAIN_GROUPED_GEMM", raising=False)
    monkeypatch.setattr(torch_internals, "_DEVICE_FACTS", {})  # probed again, through the checkers
    fp8train.inspection.reset()


def _run(splits, recipe, bias=False, steps=2, pad_outside=False):
    """y, x.grad and every parameter's gradient of a bf16 GroupedLinear(4, 64, 32) over `steps` steps
    (changing data: delayed scaling's scales move off 1), and the grouped checker's calls."""
    torch.manual_seed(0)
    module = fp8train.GroupedLinear(4, 64, 32, bias=bias).to(torch.bfloat16)
    out = []
    with cuda_contract() as per_gemm, cuda_grouped_contract() as grouped:
        for step in range(steps):
            torch.manual_seed(10 + step)
            x = (torch.randn(sum(splits), 64) * (1 + step)).to(torch.bfloat16).requires_grad_()
            g = torch.randn(sum(splits), 32).to(torch.bfloat16)
            inp, call_splits = x, splits
            if pad_outside:
                inp, call_splits = fp8train.pad_groups(x, splits, 16)
            with fp8train.fp8_autocast(fp8_recipe=recipe):
                y = module(inp, call_splits)
            if pad_outside:
                y = fp8train.unpad_groups(y, splits, call_splits)
            y.backward(g)
            out += [y.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]
            module.zero_grad()
    assert not per_gemm.violations, "\n".join(per_gemm.violations[:5])
    assert not grouped.violations, "\n".join(grouped.violations[:5])
    return out, grouped.calls


def _gemm_calls(calls) -> list[str]:
    """The kinds of the grouped calls of the layer (the probes' 32-row calls left out)."""
    return [c["kind"] for c in calls if not any(offs in c["summary"] for offs in PROBE_OFFS)]


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_gemms_equal_one_gemm_per_group_bit_for_bit(name: str, monkeypatch) -> None:
    native, calls = _run(ALIGNED, RECIPES[name]())
    kinds = _gemm_calls(calls)
    if name.endswith("e4m3"):  # forward and dgrad 2d-3d, wgrad 2d-2d, per step
        assert kinds == ["grouped 2d-3d", "grouped 2d-3d", "grouped 2d-2d"] * 2, kinds
    else:  # E5M2 gradients: the kernel multiplies E4M3 only, so backward runs per group
        assert kinds == ["grouped 2d-3d"] * 2, kinds
    monkeypatch.setenv("FP8TRAIN_GROUPED_GEMM", "off")
    per_group, calls = _run(ALIGNED, RECIPES[name]())
    assert _gemm_calls(calls) == []
    for i, (a, b) in enumerate(zip(native, per_group)):
        assert not a.isnan().any(), i  # the empty expert's weight gradient: 0, not the kernel's NaN
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())


@pytest.mark.parametrize("name", ["delayed_e4m3", "current_e4m3"])
def test_groups_off_16_rows_are_padded_inside(name: str) -> None:
    """The checker holds every group to 16 rows: unpadded groups would be violations. (E4M3: all three
    GEMMs grouped; with HYBRID the per-group backward GEMMs of groups off 16 are emulated, as a Linear's
    of that many tokens, and those of padded groups are not.)"""
    inside, calls = _run(OFF_16, RECIPES[name]())
    assert _gemm_calls(calls)
    outside, _ = _run(OFF_16, RECIPES[name](), pad_outside=True)
    for i, (a, b) in enumerate(zip(inside, outside)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())


def test_grouped_gemms_against_the_cpu_emulation(monkeypatch) -> None:
    """Both are exact products of the same FP8 values; they differ in rounding only: the emulation
    rounds each group's product to bf16 before its scale (two roundings), the kernel once after it."""
    splits = OFF_16
    native, calls = _run(splits, RECIPES["delayed_e4m3"](), bias=True)
    assert _gemm_calls(calls)
    monkeypatch.delenv("FP8TRAIN_GEMM")
    emulated, calls = _run(splits, RECIPES["delayed_e4m3"](), bias=True)
    assert _gemm_calls(calls) == []
    # reductions: 64 (forward), 32 (dgrad), up to 45 tokens (wgrad); magnitudes of the products bounded
    # by the largest |y| of the two, times the inputs' spread (random data: within 100x)
    for i, (a, b) in enumerate(zip(native, emulated)):
        a, b = a.float(), b.float()
        scale = torch.maximum(a.abs(), b.abs())
        tol = 2.0**-6 * scale + relative_bound(64) * 100 * scale.max() + 1e-30
        assert ((a - b).abs() <= tol).all(), (i, ((a - b).abs() / tol).max())
    # step 1's scales are not powers of 2: the two roundings differ somewhere (the bound is not vacuous)
    assert any(not torch.equal(a, b) for a, b in zip(native, emulated))


@pytest.mark.parametrize("fmt", [E4M3, HYBRID])
def test_mxfp8_grouped_gemms_equal_one_mx_gemm_per_expert_bit_for_bit(fmt, monkeypatch) -> None:
    """Forward and dgrad through the grouped MX kernel (the checker reads each group's scales from its
    own blocks), wgrad per expert; against FP8TRAIN_GROUPED_GEMM=off (one MX torch._scaled_mm per expert,
    the per-GEMM checker): equal bit for bit, an empty expert and groups of 32, 160 and 96 rows (one and
    two 128-row tiles of scales, a partial one each), K = 64 and 32 (2 and 1 scale columns, padded to 4).
    HYBRID's E5M2 gradients: dgrad per expert too (the kernel multiplies E4M3 only)."""
    recipe = lambda: fp8train.MXFP8BlockScaling(fp8_format=fmt)  # noqa: E731
    native, calls = _run(MX_SPLITS, recipe())
    per_step = ["grouped mx 2d-3d", "grouped mx 2d-3d"] if fmt is E4M3 else ["grouped mx 2d-3d"]
    assert _gemm_calls(calls) == per_step * 2, _gemm_calls(calls)
    monkeypatch.setenv("FP8TRAIN_GROUPED_GEMM", "off")
    per_expert, calls = _run(MX_SPLITS, recipe())
    assert _gemm_calls(calls) == []
    for i, (a, b) in enumerate(zip(native, per_expert)):
        assert not a.isnan().any(), i
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())


def test_mxfp8_grouped_calls_pass_torchs_meta_checks(monkeypatch) -> None:
    """Every MX grouped call fp8train makes, replayed on the meta device: torch's own checks
    (`meta_scaled_grouped_mm`: dtypes, layouts, the 3-D operand's blocked scale shape) accept it; and
    coverage names the experts' path "scaled_grouped_mm" under MXFP8."""
    seen = []
    real = grouped_gemm.scaled_grouped_mm

    def recording(*args):
        seen.append([a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
        return real(*args)

    monkeypatch.setattr(grouped_gemm, "scaled_grouped_mm", recording)
    _run(MX_SPLITS, fp8train.MXFP8BlockScaling(), steps=1)
    assert len(seen) == 2  # forward, dgrad
    for mat_a, mat_b, scale_a, scale_b, offs, fast in seen:
        assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu
        y = torch.ops.aten._scaled_grouped_mm(
            mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast
        )
        assert tuple(y.shape) == (mat_a.shape[0], mat_b.shape[2])
    module = fp8train.GroupedLinear(3, 64, 32).to(torch.bfloat16)
    with cuda_contract(), cuda_grouped_contract():
        report = fp8train.coverage(module, fp8train.MXFP8BlockScaling())
    assert [layer.path for layer in report.layers] == ["scaled_grouped_mm"] * 3


def test_mxfp8_grouped_scales_are_read_per_group() -> None:
    """The checker's MX product can fail: the same call with the groups' scale blocks swapped (the
    layout of one block of all groups' rows, not one per group) is refused or computes another product."""
    torch.manual_seed(0)
    e8m0 = torch.float8_e8m0fnu
    rows = torch.randn(64, 64).to(torch.float8_e4m3fn)
    experts = torch.randn(2, 32, 64).to(torch.float8_e4m3fn).transpose(-2, -1)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    bytes_a = torch.randint(120, 134, (256, 4), dtype=torch.uint8)
    bytes_b = torch.randint(120, 134, (2, 512), dtype=torch.uint8)
    with cuda_grouped_contract() as checker:
        y = torch._scaled_grouped_mm(rows, experts, bytes_a.view(e8m0), bytes_b.view(e8m0), offs=offs,
                                     out_dtype=torch.bfloat16)  # fmt: skip
        swapped = torch.cat([bytes_a[128:], bytes_a[:128]])
        z = torch._scaled_grouped_mm(rows, experts, swapped.view(e8m0), bytes_b.view(e8m0), offs=offs,
                                     out_dtype=torch.bfloat16)  # fmt: skip
        assert not checker.violations, checker.violations
        # one 128-row block of scales for both groups; then the MX 2d-2d form (not modelled)
        torch._scaled_grouped_mm(
            rows, experts, bytes_a[:128].view(e8m0), bytes_b.view(e8m0), offs=offs, out_dtype=torch.bfloat16
        )
        mx_a = bytes_a.view(e8m0)
        torch._scaled_grouped_mm(rows.t().contiguous(), rows, mx_a, mx_a, offs=offs, out_dtype=torch.bfloat16)
    rules = " / ".join(checker.violations)
    assert "MX scale_a must be each group's blocked scales: (256, 4)" in rules
    assert "the checker models MX scales of the 2d-3d form only" in rules
    assert not y.isnan().any() and not torch.equal(y, z)
    # group 0 by hand: its rows' scales from its own block (cuBLAS's offset formula, rows < 32)
    r, c = torch.arange(32)[:, None], torch.arange(2)[None, :]
    scale = torch.exp2(bytes_a.reshape(-1)[r * 16 + c].double() - 127).repeat_interleave(32, 1)
    scale_b = torch.exp2(bytes_b[0][r * 16 + c].double() - 127).repeat_interleave(32, 1)  # [N, K]
    expected = (rows[:32].double() * scale) @ (experts[0].t().double() * scale_b).t()
    assert torch.equal(y[:32], expected.to(torch.bfloat16))


def test_mxfp8_grouped_only_on_capability_10(monkeypatch) -> None:
    """The MX grouped kernel is SM100's (torch's MXFP8 grouped GEMM): 9.x keeps one GEMM per expert
    under MXFP8 while the row-wise form runs; 10.x takes both (the recipes' GEMMs and the probes faked)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(grouped_gemm, "kernel_choice", lambda kernel, device: (True, "faked"))
    facts = {("cuda", 0, "grouped"): "", ("cuda", 0, "grouped_mxfp8"): ""}
    monkeypatch.setattr(torch_internals, "_DEVICE_FACTS", {**facts, ("capability", 0): (9, 0)})
    assert grouped_kernel_choice(cuda) == (True, "torch._scaled_grouped_mm runs on cuda (probed)")
    native, why = grouped_kernel_choice(cuda, "mxfp8")
    assert not native and "mxfp8 kernel needs compute capability 10.x" in why and "9.0" in why
    monkeypatch.setattr(torch_internals, "_DEVICE_FACTS", {**facts, ("capability", 0): (10, 0)})
    assert grouped_kernel_choice(cuda, "mxfp8")[0] and grouped_kernel_choice(cuda)[0]
    assert grouped_kernel_choice(cuda, "nvfp4")[0] is False


@pytest.mark.parametrize("name", ["block", "nvfp4", "fp32_output", "setting_off"])
def test_what_runs_one_gemm_per_group(name: str, monkeypatch) -> None:
    recipe = {
        "block": fp8train.Float8BlockScaling,
        "nvfp4": fp8train.NVFP4BlockScaling,
    }.get(name, RECIPES["delayed_e4m3"])()
    if name == "setting_off":
        monkeypatch.setenv("FP8TRAIN_GROUPED_GEMM", "off")
    dtype = torch.float32 if name == "fp32_output" else torch.bfloat16
    torch.manual_seed(0)
    module = fp8train.GroupedLinear(2, 128, 128).to(dtype)
    with cuda_contract(), cuda_grouped_contract() as grouped:
        x = torch.randn(64, 128, dtype=dtype, requires_grad=True)
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            module(x, [32, 32]).sum().backward()
    assert grouped.calls == [] and not grouped.violations


def test_the_choice_and_its_reasons(monkeypatch) -> None:
    cpu = torch.device("cpu")
    native, why = grouped_kernel_choice(cpu)  # no kernel registered: the probe fails
    assert not native and "torch._scaled_grouped_mm" in why
    monkeypatch.setattr(torch_internals, "_DEVICE_FACTS", {})
    with cuda_contract(), cuda_grouped_contract():
        assert grouped_kernel_choice(cpu) == (True, "torch._scaled_grouped_mm runs on cpu (probed)")
        monkeypatch.setenv("FP8TRAIN_GROUPED_GEMM", "off")
        assert grouped_kernel_choice(cpu)[0] is False
        monkeypatch.setenv("FP8TRAIN_GROUPED_GEMM", "sometimes")
        with pytest.raises(ValueError, match="auto or off"):
            grouped_kernel_choice(cpu)
    monkeypatch.delenv("FP8TRAIN_GROUPED_GEMM")
    monkeypatch.delenv("FP8TRAIN_GEMM")
    assert grouped_kernel_choice(cpu) == (
        False,
        "cpu GEMMs are emulated (unless FP8TRAIN_GEMM=scaled_mm on the CPU)",
    )


def test_experts_with_rows_past_the_last_offset() -> None:
    """grouped_mm's convention: rows from offs[-1] on belong to no group (0 here); the checker leaves
    them NaN, so only rows of groups may reach it."""
    torch.manual_seed(0)
    experts = fp8train.ExpertsLinear(3, 64, 32).to(torch.bfloat16)
    x = torch.randn(100, 64, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([16, 16, 80], dtype=torch.int32)
    with cuda_contract(), cuda_grouped_contract() as grouped:
        with fp8train.fp8_autocast(fp8_recipe=RECIPES["delayed_e4m3"]()):
            y = experts(x, offs)
        y.float().square().sum().backward()
    assert not grouped.violations and _gemm_calls(grouped.calls)
    assert torch.equal(y[80:], torch.zeros_like(y[80:])) and not y.isnan().any()
    assert not x.grad.isnan().any() and not experts.weight.grad.isnan().any()
    assert torch.equal(experts.weight.grad[1], torch.zeros_like(experts.weight.grad[1]))  # empty expert


def test_the_checker_reports_broken_rules() -> None:
    fp8 = torch.float8_e4m3fn
    rows = torch.ones(32, 16, dtype=fp8)
    with cuda_grouped_contract() as checker:
        torch._scaled_grouped_mm(
            rows, torch.ones(2, 16, 16, dtype=fp8),  # row-major experts
            torch.ones(32), torch.ones(2, 8),  # a scale of the wrong width
            offs=torch.tensor([8, 32], dtype=torch.int32),  # a group of 8 rows
            out_dtype=torch.bfloat16,
        )  # fmt: skip
        torch._scaled_grouped_mm(
            rows.float().to(torch.float8_e5m2), torch.ones(2, 16, 16, dtype=fp8).transpose(-2, -1),
            torch.ones(32), torch.ones(2, 16), offs=torch.tensor([16, 32]), out_dtype=torch.float32,
        )  # fmt: skip
    rules = " / ".join(checker.violations)
    for rule in (
        "mat_b must be column-major", "scale_b must be (groups, columns)",
        "every group a multiple of 16 rows", "operands must both be float8_e4m3fn",
        "offs must be a 1-D int32 tensor", "the output must be bf16",
    ):  # fmt: skip
        assert rule in rules, (rule, rules)


def test_coverage_names_the_grouped_path(monkeypatch) -> None:
    """coverage and StepCoverage report the experts' GEMMs as "scaled_grouped_mm" where the grouped
    kernel takes them, and as a Linear's path where it does not (the CPU's default)."""
    torch.manual_seed(0)
    module = fp8train.GroupedLinear(3, 64, 32).to(torch.bfloat16)
    recipe = RECIPES["delayed_e4m3"]()
    default = fp8train.coverage(module, recipe)
    assert {layer.path for layer in default.layers} == {"scaled_mm"}  # FP8TRAIN_GEMM=scaled_mm, no kernel
    monkeypatch.setattr(torch_internals, "_DEVICE_FACTS", {})  # the failed probe is kept: probe again
    with cuda_contract(), cuda_grouped_contract():
        report = fp8train.coverage(module, recipe)
        assert [layer.path for layer in report.layers] == ["scaled_grouped_mm"] * 3
        steps = StepCoverage(module)
        x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            module(x, [16, 0, 32]).sum().backward()
        assert steps.take()["gemms"] == {"scaled_grouped_mm": 9}  # 3 experts x 3 GEMMs


def _microbatches(recompute: bool):
    """Two microbatches with the weight cache (is_first_microbatch True, then False), the second under
    fp8train.checkpoint when `recompute`, over 2 steps: outputs and gradients, and the grouped calls."""
    torch.manual_seed(0)
    module = fp8train.GroupedLinear(3, 64, 32, bias=False).to(torch.bfloat16)  # bias: see the bound test
    recipe = RECIPES["delayed_e4m3"]()
    splits = [16, 32, 0]
    out = []
    with cuda_contract(), cuda_grouped_contract() as grouped:
        for step in range(2):
            for micro, first in enumerate((True, False)):
                torch.manual_seed(100 * step + micro)
                x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
                with fp8train.fp8_autocast(fp8_recipe=recipe):
                    if recompute and not first:
                        y = fp8train.checkpoint(module, x, splits, first)
                    else:
                        y = module(x, splits, is_first_microbatch=first)
                y.float().square().sum().backward()
                out += [y.detach(), x.grad]
            out += [p.grad.clone() for p in module.parameters()]
            module.zero_grad()
    assert not grouped.violations
    return out, _gemm_calls(grouped.calls)


@pytest.mark.parametrize("recompute", [False, True])
def test_weight_cache_and_recomputation_through_the_grouped_kernel(recompute: bool, monkeypatch) -> None:
    native, kinds = _microbatches(recompute)
    assert kinds.count("grouped 2d-2d") == 4  # a weight gradient per microbatch and step
    monkeypatch.setenv("FP8TRAIN_GROUPED_GEMM", "off")
    per_group, kinds = _microbatches(recompute)
    assert kinds == []
    for i, (a, b) in enumerate(zip(native, per_group)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())


def _qwen3_moe_losses(steps: int = 2):
    """A tiny bf16 Qwen3-MoE (built from its config) converted by convert_to_fp8, trained `steps` SGD
    steps under delayed scaling E4M3: its losses and the grouped checker's calls."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts_per_tok=2, intermediate_size=128, moe_intermediate_size=32,
        head_dim=16, num_experts=4, decoder_sparse_step=1,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.config._experts_implementation = "eager"
    fp8train.convert_to_fp8(model, log=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.randint(0, 96, (2, 24))
    losses = []
    with cuda_contract(), cuda_grouped_contract() as grouped:
        for _ in range(steps):
            with fp8train.fp8_autocast(fp8_recipe=RECIPES["delayed_e4m3"]()):
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert not grouped.violations, grouped.violations[:3]
    return losses, _gemm_calls(grouped.calls)


def test_transformers_fused_experts_take_the_grouped_kernel(monkeypatch) -> None:
    """FusedExperts (Qwen3-MoE's converted experts: any routing, groups off 16 rows padded inside):
    gate_up and down grouped, each GEMM of each role once per step; losses as one GEMM per expert's
    (not bit for bit: the per-expert GEMMs of groups off 16 rows are emulated, see above)."""
    native, kinds = _qwen3_moe_losses()
    assert kinds.count("grouped 2d-2d") == 2 * 2  # gate_up and down, per step
    assert kinds.count("grouped 2d-3d") == 2 * 2 * 2  # forward and dgrad of both, per step
    monkeypatch.setenv("FP8TRAIN_GROUPED_GEMM", "off")
    per_expert, kinds = _qwen3_moe_losses()
    assert kinds == []
    assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(native, per_expert)), (native, per_expert)

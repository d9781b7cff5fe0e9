"""The GEMM kernels fp8train picks on each device, with the CUDA branches forced on
the CPU: torch._scaled_mm probed once per device and kernel before it is trusted; fast accumulation
for the forward GEMM only; the block-scaled kernels (1x128/128x128 on SM90, MXFP8 and NVFP4 on
SM100+) chosen by capability and probe, fed cuBLAS's layouts (checked against naive references and
torch's meta kernels) and equal to the emulation up to the order of fp32 accumulation; MXFP8/NVFP4
shapes off the block refused; the emulation's fp32 matmuls guarded against TF32 and autocast."""

from __future__ import annotations

import warnings

import pytest
import torch

import fp8train
from cuda_contract import cuda_contract, relative_bound
from fp8train import torch_internals
from fp8train.numerics import block_scaled_mm, gemm
from fp8train.numerics.microscaling import e8m0_to_float, swizzle_scales
from fp8train.quantization import quantization_of
from inverses import unswizzle_scales

CUDA0 = torch.device("cuda", 0)
RECIPES = {
    "block": fp8train.Float8BlockScaling(),
    "mxfp8": fp8train.MXFP8BlockScaling(),
    "mxfp8_hybrid_2d": fp8train.MXFP8BlockScaling(
        fp8_format=fp8train.Format.HYBRID, enable_2d_quantization=True
    ),
    "nvfp4": fp8train.NVFP4BlockScaling(),
}
KINDS = {"block": "1x128", "mxfp8": "mx", "mxfp8_hybrid_2d": "mx", "nvfp4": "nvfp4"}


@pytest.fixture
def fresh_facts(monkeypatch):
    """An empty registry of device facts for the test (probes and capabilities found again)."""
    facts: dict = {}
    # the facts of a device simulated on the CPU: torch_internals' own cache, which no setting may fill
    monkeypatch.setattr(torch_internals, "_DEVICE_FACTS", facts)
    return facts


def _fake_cuda(monkeypatch, capability, probe=None) -> list:
    """CUDA device 0 of `capability` on this CPU machine; `probe(kernel, device)` stands in for the
    device's kernels (raising where one fails). Returns the log of capability queries and probes."""
    log = []

    def get_capability(index):
        log.append(("capability", index))
        return capability

    def run_probe(kernel, device):
        log.append(("probe", kernel, str(device)))
        if probe is not None:
            probe(kernel, device)

    monkeypatch.setattr(torch.cuda, "get_device_capability", get_capability)
    monkeypatch.setattr(torch_internals, "_probe", run_probe)  # a kernel launch on a simulated device
    return log


def _cuda_failure(kernel, device):
    raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")


# ---- probed once per device before it is trusted -------------------------------------------


def test_a_failing_probe_falls_back_to_the_emulation_with_one_warning(monkeypatch, fresh_facts) -> None:
    monkeypatch.delenv("FP8TRAIN_GEMM", raising=False)
    log = _fake_cuda(monkeypatch, (8, 9), _cuda_failure)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = [gemm.choose_path(CUDA0, 64, 64, 64) for _ in range(5)]
    assert paths == ["bf16"] * 5
    messages = [str(w.message) for w in caught if "fp8train" in str(w.message)]
    assert len(messages) == 1 and "CUBLAS_STATUS_NOT_SUPPORTED" in messages[0] and "emulated" in messages[0]
    assert log.count(("capability", 0)) == 1  # asked once for five choices
    assert log.count(("probe", "tensorwise", "cuda:0")) == 1
    ok, why = gemm.kernel_choice("tensorwise", CUDA0)
    assert not ok and "CUBLAS_STATUS_NOT_SUPPORTED" in why


def test_a_passing_probe_is_trusted_once_per_device_index(monkeypatch, fresh_facts) -> None:
    monkeypatch.delenv("FP8TRAIN_GEMM", raising=False)
    log = _fake_cuda(monkeypatch, (9, 0))
    for _ in range(3):
        assert gemm.choose_path(CUDA0, 64, 64, 64) == "scaled_mm"
        assert gemm.choose_path(torch.device("cuda", 1), 64, 64, 64) == "scaled_mm"
    assert [entry for entry in log if entry[0] == "probe"] == [
        ("probe", "tensorwise", "cuda:0"),
        ("probe", "tensorwise", "cuda:1"),
    ]
    assert gemm.choose_path(CUDA0, 64, 64, 24) == "bf16"  # a shape _scaled_mm cannot take


def test_the_probe_calls_both_dtype_pairs_and_checks_the_product(monkeypatch) -> None:
    """The real probe (on the CPU, through a dispatcher-level kernel): e4m3 x e4m3 -> bf16 and
    e5m2 x e4m3 -> fp32, and a kernel that computes a wrong product fails it."""
    with cuda_contract() as checker:
        torch_internals._probe("tensorwise", torch.device("cpu"))
    summaries = [call["summary"] for call in checker.calls]
    assert "torch.float8_e4m3fn x (16, 16)(1, 16) torch.float8_e4m3fn" in summaries[0]
    assert "out torch.bfloat16" in summaries[0]
    assert summaries[1].split(" x ")[0].endswith("torch.float8_e5m2") and "out torch.float32" in summaries[1]
    assert not checker.violations
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        library.impl("_scaled_mm", lambda a, b, *args, **kwargs: torch.zeros(a.shape[0], b.shape[1]), "CPU")
    try:
        with pytest.raises(RuntimeError, match="wrong product"):
            torch_internals._probe("tensorwise", torch.device("cpu"))
    finally:
        library._destroy()


# ---- fast accumulation for the forward GEMM only -------------------------------------------


def _fast_accum_flags(monkeypatch, setting) -> list[bool]:
    monkeypatch.setenv("FP8TRAIN_GEMM", "scaled_mm")
    if setting is None:
        monkeypatch.delenv("FP8TRAIN_FAST_ACCUM", raising=False)
    else:
        monkeypatch.setenv("FP8TRAIN_FAST_ACCUM", setting)
    layer = fp8train.Linear(64, 32)
    x = torch.randn(32, 64, requires_grad=True)
    with cuda_contract() as checker:
        with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8CurrentScaling()):
            y = layer(x)
        y.backward(torch.randn_like(y))
    assert not checker.violations
    gemms = [call for call in checker.calls if "(16, 16)" not in call["summary"]]  # not the probes
    assert len(gemms) == 3  # forward, dgrad, wgrad, in that order
    return [call["summary"].endswith("fast_accum True") for call in gemms]


@pytest.mark.parametrize(
    "setting, flags",
    [
        (None, [True, False, False]),
        ("forward", [True, False, False]),
        ("all", [True] * 3),
        ("none", [False] * 3),
    ],
)
def test_fast_accumulation_reaches_scaled_mm_for_the_forward_gemm(
    monkeypatch, fresh_facts, setting, flags
) -> None:
    assert _fast_accum_flags(monkeypatch, setting) == flags


def test_a_bad_fast_accumulation_setting_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("FP8TRAIN_FAST_ACCUM", "yes")
    with pytest.raises(ValueError, match="FP8TRAIN_FAST_ACCUM='yes'.*forward, all or none"):
        gemm.fast_accumulation("forward")


# ---- the block-scaled kernels --------------------------------------------------------------


def _naive_blocked(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS's blocked layout, element by element from its offset formula."""
    rows, cols = scales.shape
    col_tiles = -(-cols // 4)
    out = torch.zeros(-(-rows // 128) * 128 * col_tiles * 4, dtype=scales.dtype)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * col_tiles + c // 4
            out[tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4] = scales[r, c]
    return out


@pytest.mark.parametrize("rows, cols", [(128, 4), (200, 7), (1, 1), (256, 9), (130, 4)])
def test_swizzle_matches_the_blocked_layout_and_inverts(rows, cols) -> None:
    scales = torch.arange(1, rows * cols + 1, dtype=torch.int32).reshape(rows, cols)
    blocked = swizzle_scales(scales)
    assert torch.equal(blocked, _naive_blocked(scales))
    assert torch.equal(unswizzle_scales(blocked, rows, cols), scales)


def test_e8m0_bytes_invert_the_decoded_scales() -> None:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(block_scaled_mm.e8m0_bytes(e8m0_to_float(every)), every)


def _gemm_operands(name: str, tokens: int, k: int, n: int):
    """The operands of the three GEMMs of a layer under recipe `name`, as fp8_linear pairs them."""
    q = quantization_of(RECIPES[name])
    g = torch.Generator().manual_seed(5)
    x, w, grad = (torch.randn(*s, generator=g) for s in ((tokens, k), (n, k), (tokens, n)))
    inputs, weights, grads = (
        q.quantize_input(x, None),
        q.quantize_weight(w, None),
        q.quantize_grad(grad, None, (True, True)),
    )
    return {
        "forward": (inputs.forward, weights.forward.t()),
        "dgrad": (grads.dgrad, weights.dgrad),
        "wgrad": (grads.wgrad.t(), inputs.wgrad),
    }


def _kernel_arguments(monkeypatch, fmt, a, b) -> tuple:
    captured = []
    # the call into torch, captured (no CPU kernel takes these layouts): a spy, not a setting
    monkeypatch.setattr(block_scaled_mm, "scaled_mm", lambda *args: captured.append(args) or torch.zeros(1))
    block_scaled_mm.block_scaled_mm(fmt, a, b, torch.bfloat16, None, False)
    return captured[0]


@pytest.mark.parametrize("name", list(RECIPES))
def test_torchs_meta_kernels_accept_the_block_scaled_calls(monkeypatch, name) -> None:
    """torch's own shape checks of the CUDA kernel (its meta function on fake CUDA tensors) take what
    block_scaled_mm builds for forward, dgrad and wgrad."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for role, (a, b) in _gemm_operands(name, 256, 512, 512).items():
        fmt = block_scaled_mm.block_format(a, b)
        assert fmt == name.split("_")[0], role
        mat1, mat2, scale_a, scale_b, out_dtype, *_ = _kernel_arguments(monkeypatch, fmt, a, b)
        with FakeTensorMode():
            fake = [
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                for t in (mat1, mat2, scale_a, scale_b)
            ]
            y = torch._scaled_mm(*fake[:2], scale_a=fake[2], scale_b=fake[3], out_dtype=out_dtype)
        assert y.shape == (mat1.shape[0], mat2.shape[1]), role


def test_the_kernel_choice_follows_capability_and_probe(monkeypatch, fresh_facts) -> None:
    monkeypatch.delenv("FP8TRAIN_GEMM", raising=False)
    expected = {
        (8, 9): {"tensorwise": True, "block": False, "mxfp8": False, "nvfp4": False},
        (9, 0): {"tensorwise": True, "block": True, "mxfp8": False, "nvfp4": False},
        (10, 0): {"tensorwise": True, "block": False, "mxfp8": True, "nvfp4": True},
        (8, 6): {"tensorwise": False, "block": False, "mxfp8": False, "nvfp4": False},
    }
    for capability, kernels in expected.items():
        torch_internals._DEVICE_FACTS.clear()
        _fake_cuda(monkeypatch, capability)
        assert {k: gemm.kernel_choice(k, CUDA0)[0] for k in kernels} == kernels, capability
    ok, why = gemm.kernel_choice("mxfp8", CUDA0)  # 8.6 (last in the loop)
    assert not ok and "10.0" in why and "8.6" in why
    # SM90 with a cuBLASLt before 12.9: the block probe fails, block scaling is emulated, once said
    torch_internals._DEVICE_FACTS.clear()

    def old_cublas(kernel, device):
        if kernel == "block":
            raise NotImplementedError("DeepSeek style (1x128, 128x128) scaling requires cublasLt >= 12.9")

    _fake_cuda(monkeypatch, (9, 0), old_cublas)
    with pytest.warns(UserWarning, match="cublasLt >= 12.9"):
        ok, why = gemm.kernel_choice("block", CUDA0)
    assert not ok and "12.9" in why and gemm.kernel_choice("tensorwise", CUDA0)[0]
    # a torch without the MX scale dtype: found before any call
    torch_internals._DEVICE_FACTS.clear()
    monkeypatch.delattr(torch, "float8_e8m0fnu")
    _fake_cuda(monkeypatch, (10, 0))
    with pytest.warns(UserWarning, match="float8_e8m0fnu"):
        assert not gemm.kernel_choice("mxfp8", CUDA0)[0]
    # the setting: emulation forced; auto on the CPU emulates, scaled_mm there probes
    monkeypatch.setenv("FP8TRAIN_GEMM", "bf16")
    assert not gemm.kernel_choice("nvfp4", CUDA0)[0]
    monkeypatch.delenv("FP8TRAIN_GEMM")
    ok, why = gemm.kernel_choice("block", torch.device("cpu"))
    assert not ok and "unless FP8TRAIN_GEMM=scaled_mm" in why


def _layer_run(name: str, gemm_setting: str, monkeypatch, tokens=256, k=512, n=512, dtype=torch.float32):
    monkeypatch.setenv("FP8TRAIN_GEMM", gemm_setting)
    fp8train.inspection.reset()
    torch.manual_seed(0)
    layer = fp8train.Linear(k, n, bias=False).to(dtype)
    x = torch.randn(tokens, k, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, n, dtype=dtype)
    torch.manual_seed(1)  # NVFP4's stochastic rounding: the same draws in both runs
    with fp8train.fp8_autocast(fp8_recipe=RECIPES[name]):
        y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad, (x.detach(), layer.weight.detach(), g)


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_native_kernels_equal_the_emulation_up_to_accumulation_order(
    monkeypatch, fresh_facts, name
) -> None:
    """Forward, dgrad and wgrad through the block-scaled kernels (the CPU kernel of torch._scaled_mm
    replaced by the CUDA-contract checker, which computes the product of the dequantized operands)
    against the emulation: the differences are those of fp32 sums taken in another order (and, for
    NVFP4, of dividing by the tensor scales once instead of per element), bounded by gamma_K of the
    sum of |products| per output (|a| @ |b| of the dequantized operands), plus one rounding."""
    emulated = _layer_run(name, "fp32", monkeypatch)
    with cuda_contract() as checker:
        probes = _probe_first(monkeypatch, checker, name)
        native = _layer_run(name, "scaled_mm", monkeypatch)
    assert not checker.violations, checker.violations[:3]
    kinds = [call["kind"] for call in checker.calls[probes:]]
    assert sum(KINDS[name] in kind for kind in kinds) == 3, kinds  # forward, dgrad, wgrad: native
    operands = _gemm_operands_of_run(name, *emulated[3])
    for role, (e, n_) in zip(("forward", "dgrad", "wgrad"), zip(emulated[:3], native[:3])):
        a, b = operands[role]
        magnitude = a.dequantize().abs() @ b.dequantize().abs()
        k = a.oriented().shape[1]
        bound = 2 * relative_bound(k) * magnitude + 2.0**-23 * magnitude + 1e-30
        assert bool(((e - n_).abs() <= bound).all()), (role, float((e - n_).abs().max()))


def _probe_first(monkeypatch, checker, name: str) -> int:
    """Probe the recipe's kernel on the CPU now (through the checker): the calls after are the layer's."""
    monkeypatch.setenv("FP8TRAIN_GEMM", "scaled_mm")
    assert gemm.kernel_choice(name.split("_")[0], torch.device("cpu"))[0]
    return len(checker.calls)


def _gemm_operands_of_run(name, x, w, g):
    q = quantization_of(RECIPES[name])
    torch.manual_seed(1)
    inputs, weights = q.quantize_input(x, None), q.quantize_weight(w, None)
    grads = q.quantize_grad(g, None, (True, True))
    return {
        "forward": (inputs.forward, weights.forward.t()),
        "dgrad": (grads.dgrad, weights.dgrad),
        "wgrad": (grads.wgrad.t(), inputs.wgrad),
    }


def test_shapes_the_block_kernel_cannot_take_are_emulated(monkeypatch, fresh_facts) -> None:
    """A forward GEMM with partial tiles, a single tile along K, or a 128x128 weight whose K/128 is
    not a multiple of 4 is emulated: no call reaches torch._scaled_mm; a whole one does."""
    shapes = {(200, 512, 512): False, (128, 128, 512): False, (256, 384, 512): False, (256, 512, 384): True}
    for (tokens, k, n), native in shapes.items():
        a, b = _gemm_operands("block", tokens, k, n)["forward"]
        with cuda_contract() as checker:
            probes = _probe_first(monkeypatch, checker, "block")
            y = gemm.matmul(a, b, torch.float32)
        assert not checker.violations
        assert len(checker.calls) - probes == int(native), (tokens, k, n)
        expected = a.dequantize() @ b.dequantize()
        assert bool(
            (
                (y - expected).abs() <= 2 * relative_bound(k) * (a.dequantize().abs() @ b.dequantize().abs())
            ).all()
        )


# ---- MXFP8/NVFP4 shapes off the block ----------------------------------------------------


@pytest.mark.parametrize("recipe, block", [(RECIPES["mxfp8"], 32), (RECIPES["nvfp4"], 16)])
def test_shapes_off_the_block_are_refused_naming_the_block(recipe, block) -> None:
    for features, tokens, off in (((64, 48), 64, "out_features = 48"), ((64, 64), 40, "tokens = 40")):
        if block == 16 and off.startswith("out"):
            features, off = (64, 40), "out_features = 40"
        layer = fp8train.Linear(*features)
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            with pytest.raises(ValueError, match=rf"blocks of {block}.*{off}"):
                layer(torch.randn(tokens, features[0]))


@pytest.mark.parametrize(
    "recipe, kept", [(RECIPES["mxfp8"], {"b", "c"}), (RECIPES["nvfp4"], {"c"}), (None, {"c"})]
)
def test_convert_and_prepare_keep_layers_off_the_block_in_high_precision(recipe, kept) -> None:
    def model():
        return torch.nn.Sequential(
            torch.nn.ModuleDict(
                {"a": torch.nn.Linear(64, 64), "b": torch.nn.Linear(64, 48), "c": torch.nn.Linear(48, 24)}
            )
        )

    for convert in (fp8train.convert_to_fp8, fp8train.prepare):
        m = model()
        if recipe is None:
            convert(m)
        else:
            convert(m, recipe=recipe)
        plain = {name for name, layer in m[0].items() if not isinstance(layer, fp8train.FP8Module)}
        assert plain == kept, (convert.__name__, recipe)


# ---- the emulation's fp32 matmuls stay fp32 ------------------------------------------------


class _MatmulState(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the fp32 matmul precision and the operand dtypes each matmul op sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.matmul.default):
            self.seen.append((torch.get_float32_matmul_precision(), args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["nvfp4", "block"])
def test_the_emulated_gemms_ignore_tf32_and_autocast(monkeypatch, name) -> None:
    """NVFP4 (values / S_enc) and non-power-of-2 block scales are not exact in TF32 or bf16: with the
    script's fp32 precision "high" and CPU autocast (bf16), the layer computes what it computes
    without them, and every matmul inside ran at "highest" on fp32 operands."""
    recipe = fp8train.Float8BlockScaling(power_2_scale=False) if name == "block" else RECIPES[name]
    monkeypatch.setitem(RECIPES, name, recipe)
    plain = _layer_run(name, "fp32", monkeypatch, 64, 128, 64)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), _MatmulState() as state:
            guarded = _layer_run(name, "fp32", monkeypatch, 64, 128, 64)
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(precision)
    # the output comes in autocast's dtype (fp32's rounded once); the gradients then start from a bf16
    # grad_output, so only the matmuls' recorded precision speaks for the backward
    assert guarded[0].dtype == torch.bfloat16 and torch.equal(plain[0].to(torch.bfloat16), guarded[0])
    assert state.seen and all(s == ("highest", torch.float32, torch.float32) for s in state.seen), state.seen


# ---- fp8train info: which GEMM each recipe uses on the device, and why -----------------------------


def test_grouped_gemms_take_their_kernel_on_9x_and_10x_only_probed_once(monkeypatch, fresh_facts) -> None:
    """torch._scaled_grouped_mm's CUTLASS kernels: compute capability 9.x and 10.x (not Ada's 8.9, not
    consumer Blackwell's 12.0); one probe per device, kept with the other device facts."""
    from fp8train.modules.grouped_gemm import grouped_kernel_choice

    monkeypatch.delenv("FP8TRAIN_GEMM", raising=False)
    for capability, expected in (((8, 9), False), ((9, 0), True), ((10, 0), True), ((12, 0), False)):
        fresh_facts.clear()
        log = _fake_cuda(monkeypatch, capability)
        answers = [grouped_kernel_choice(CUDA0) for _ in range(3)]
        assert {a[0] for a in answers} == {expected}, (capability, answers)
        if expected:
            assert log.count(("probe", "grouped", "cuda:0")) == 1
        else:
            assert ("probe", "grouped", "cuda:0") not in log
            assert f"this GPU has {capability[0]}.{capability[1]}" in answers[0][1]


def test_info_says_which_gemm_each_recipe_uses_on_the_device(monkeypatch, fresh_facts, capsys) -> None:
    from fp8train.tools import cli

    monkeypatch.delenv("FP8TRAIN_GEMM", raising=False)
    monkeypatch.delenv("FP8TRAIN_FAST_ACCUM", raising=False)
    _fake_cuda(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H100 (stand-in)")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert (
        "  DelayedScaling: torch._scaled_mm (tensorwise scales): torch._scaled_mm runs its tensorwise" in out
    )
    assert "  Float8BlockScaling: torch._scaled_mm (block scales)" in out
    mxfp8 = (
        "  MXFP8BlockScaling: the emulation (block-dequantized operands, an fp32 matmul): the mxfp8 kernel "
    )
    assert mxfp8 + "needs compute capability 10.0 or newer (Blackwell); this GPU has 9.0" in out
    grouped = (
        "grouped GEMMs (mixture of experts; delayed and current scaling, bf16): torch._scaled_grouped_mm"
    )
    assert grouped + ": torch._scaled_grouped_mm runs on cuda (probed)" in out
    mx_grouped = (
        "grouped GEMMs (mixture of experts; MXFP8, bf16): one GEMM per expert: the mxfp8 kernel needs"
    )
    assert mx_grouped + " compute capability 10.0 or newer (Blackwell); this GPU has 9.0" in out
    assert "fast accumulation for forward GEMMs" in out

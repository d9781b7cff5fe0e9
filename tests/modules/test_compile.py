"""torch.compile(fullgraph=True) over models of FP8 modules.

The FP8 math traces as ordinary ops; what each call asks of the amax protocol runs in two custom ops
(fp8train/ops.py) that the compiled graph calls at run time. So:

- one graph, no break, with `fullgraph=True`, called inside `fp8_autocast`;
- `aot_eager` (dynamo and AOTAutograd, no code generator) equals eager bit for bit: losses, every
  amax history, scale and scale_inv, parameters; on 2 ranks as well, with one amax all-reduce per
  step and direction (the launches at region exit and at the end of backward still happen);
- inductor (generated kernels, which round high-precision ops such as layer norm differently in the
  last bit, differently on each CPU) stays close step by step, measured against FP8's own error, and
  every scale is still exactly fp8_max / amax of its own history;
- evaluation, calibration, gradient accumulation with `is_first_microbatch` and activation
  checkpointing inside the compiled model also equal eager bit for bit;
- blocks compiled one by one share one graph; graphs built before a registry reset still run; the
  block-scaled recipes' CUDA warning is given at trace time, outside the graph;
- what only a GPU would show, decided on the CPU: inductor's partitioning around the protocol's ops
  under mode="reduce-overhead", the refusal of CUDA-graph capture, and scale divisions that round
  as eager ones under inductor's GPU lowering.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import pytest
import torch

import fp8train
from fp8train.tools.bench.common import GraphCounter
from helpers import fp8_state, sgd
from multirank import AllReduceSpy, run_ranks

RECIPE = fp8train.DelayedScaling(amax_history_len=4)
LR = 0.1


class Net(torch.nn.Module):
    """Every FP8 module kind, with `is_first_microbatch` and optional checkpointing of the MLP."""

    def __init__(self, checkpoint: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = fp8train.LayerNormLinear(32, 64)
        self.mlp = fp8train.LayerNormMLP(64, 128)
        self.head = fp8train.Linear(64, 16)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor, first=None) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.proj(x, is_first_microbatch=first))
        if self.checkpoint == "torch":
            h = torch.utils.checkpoint.checkpoint(self.mlp, h, use_reentrant=False)
        elif self.checkpoint == "fp8train":
            h = fp8train.checkpoint(self.mlp, h)
        else:
            h = self.mlp(h, is_first_microbatch=first)
        return self.head(h, is_first_microbatch=first)


def _train(backend, steps: int = 4, rank: int = 0, group=None, mode: str = "train", checkpoint: str = ""):
    """Losses, FP8 state after each step, final parameters and amax collectives per step and direction."""
    fp8train.inspection.reset()
    torch._dynamo.reset()
    model = Net(checkpoint)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    out = {"loss": [], "state": [], "calls": []}
    with AllReduceSpy() as spy:
        for step in range(steps):
            micro = 2 if mode == "accumulate" else 1
            for i in range(micro):
                x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * rank + 10 * step + i))
                before = spy.calls
                if mode == "calibrate":
                    with torch.no_grad(), fp8train.fp8_autocast(False, True, RECIPE, group):
                        y = run(x)
                else:
                    first = (i == 0) if mode == "accumulate" else None
                    with fp8train.fp8_autocast(fp8_recipe=RECIPE, fp8_group=group):
                        y = run(x, first)
                forward_calls = spy.calls - before
                loss = y.float().square().mean()
                if mode != "calibrate":
                    loss.backward()
                out["calls"].append((forward_calls, spy.calls - before - forward_calls))
                out["loss"].append(loss.detach())
                if mode == "evaluate":
                    with torch.no_grad(), fp8train.fp8_autocast(fp8_recipe=RECIPE, fp8_group=group):
                        out["loss"].append(run(x).square().mean())
            sgd(model, LR)
            out["state"].append(fp8_state(model))
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def _assert_bitwise(a: dict, b: dict) -> None:
    assert len(a["loss"]) == len(b["loss"])
    assert all(torch.equal(x, y) for x, y in zip(a["loss"], b["loss"]))
    for sa, sb in zip(a["state"], b["state"]):
        assert all(torch.equal(x, y) for x, y in zip(sa, sb))
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def test_fullgraph_is_one_graph_and_aot_eager_equals_eager_bitwise() -> None:
    counter = GraphCounter("aot_eager")
    compiled = _train(counter)
    assert counter.graphs == 1  # fullgraph=True would have raised at a break; and nothing recompiles
    _assert_bitwise(compiled, _train(None))


def _after_reset(compiled: bool) -> tuple[torch.Tensor, str]:
    """Train 2 steps, reset the registry (fp8train.inspection.reset), then evaluate and train again:
    the evaluation's output, and the error of the training call."""
    fp8train.inspection.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fp8train.Linear(32, 32)
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            run(x).square().mean().backward()
        sgd(model, LR)
    fp8train.inspection.reset()
    with torch.no_grad(), fp8train.fp8_autocast(fp8_recipe=RECIPE):
        evaluated = run(x)
    with pytest.raises(RuntimeError) as error, fp8train.fp8_autocast(fp8_recipe=RECIPE):
        run(x)
    return evaluated, str(error.value)


@pytest.mark.slow
def test_graphs_compiled_before_a_registry_reset_find_their_modules() -> None:
    """A module keeps its handle across a reset, so a graph built before it still finds its modules
    (it raised KeyError): it evaluates as eager code does, and a training call gets eager's error (its
    FP8 state belongs to a dropped amax group)."""
    compiled, eager = _after_reset(compiled=True), _after_reset(compiled=False)
    assert torch.equal(compiled[0], eager[0])
    assert compiled[1] == eager[1] and "trains under one recipe and amax group" in eager[1]


class Blocks(torch.nn.Module):
    """A stack of residual blocks of one kind, each compiled on its own (torchtitan's pattern)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = fp8train.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


def _train_blocks(backend, n: int = 12, steps: int = 2) -> dict:
    fp8train.inspection.reset()
    torch._dynamo.reset()
    model = Blocks(n)
    if backend is not None:
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=True)
    out = {"loss": [], "state": []}
    for step in range(steps):
        # requiring grad, as every later block's input does (else the first block compiles apart)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            loss = model(x).square().mean()
        loss.backward()
        sgd(model, LR)
        out["loss"].append(loss.detach())
        out["state"].append(fp8_state(model))
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_blocks_compiled_one_by_one_share_one_graph() -> None:
    """Twelve blocks compiled separately: one compilation, not one per block (an int handle attribute
    would be guarded by value: dynamo's recompile limit, 8, hit at the ninth block), and each block's
    calls still reach its own FP8 state: bit for bit eager."""
    counter = GraphCounter("aot_eager")
    compiled = _train_blocks(counter)
    assert counter.graphs == 1
    _assert_bitwise(compiled, _train_blocks(None))


@pytest.mark.parametrize(
    "recipe",
    [
        fp8train.Float8BlockScaling(),
        pytest.param(fp8train.MXFP8BlockScaling(), marks=pytest.mark.slow),
        pytest.param(fp8train.NVFP4BlockScaling(), marks=pytest.mark.slow),
    ],
    ids=lambda recipe: type(recipe).__name__,
)
def test_emulation_warning_is_given_once_outside_the_graph(monkeypatch, recipe) -> None:
    """On CUDA the block-scaled recipes warn that their GEMM is emulated. `warnings.warn` in traced code
    is a graph break per layer, and fullgraph=True raises: it is said once, at trace time, outside the
    graph, and the model still compiles into one graph (the CUDA branch taken on the CPU)."""
    from fp8train.quantization import base

    monkeypatch.setattr(base, "EMULATION_NOTED_ON", "cpu")  # the warning's seam: its device type
    base._warn_emulated.cache_clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fp8train.Linear(32, 32)
    counter = GraphCounter("aot_eager")
    run = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(32, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with fp8train.fp8_autocast(fp8_recipe=recipe):
                run(x).square().mean().backward()
    emulated = [str(w.message) for w in caught if "runs an emulated GEMM" in str(w.message)]
    assert counter.graphs == 1
    assert len(emulated) == 1 and emulated[0].startswith(f"fp8train.{type(recipe).__name__} on this GPU")


@pytest.mark.parametrize("mode", ["evaluate", "calibrate", "accumulate"])
def test_evaluation_calibration_and_accumulation_compile_bitwise(mode: str) -> None:
    _assert_bitwise(_train("aot_eager", steps=3, mode=mode), _train(None, steps=3, mode=mode))


@pytest.mark.parametrize("checkpoint", ["torch", "fp8train"])
def test_checkpointing_inside_the_compiled_model(checkpoint: str) -> None:
    """AOTAutograd recomputes inside the graph; the protocol's ops are not replayed."""
    compiled = _train("aot_eager", steps=3, checkpoint=checkpoint)
    _assert_bitwise(compiled, _train(None, steps=3))


def _inductor_training(steps: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Train the inductor-compiled model; before each of its steps, run the same module eagerly, in FP8
    and in high precision, from the same state and on the same input. Per step: the distance of the
    compiled output from eager FP8, relative to FP8's own error (eager FP8 vs high precision)."""
    fp8train.inspection.reset()
    torch._dynamo.reset()
    model = Net()
    run = torch.compile(model, backend="inductor", fullgraph=True)
    ratios, states = [], []
    for step in range(steps):  # the inputs of _train's steps
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step))
        with torch.no_grad():  # records nothing, launches nothing: the compiled step sees the same state
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                eager = model(x)
            high = model(x)
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            y = run(x)
        y.float().square().mean().backward()
        sgd(model, LR)
        ratios.append(float((y.detach() - eager).norm() / (eager - high).norm()))
        states.append(fp8_state(model))
    return ratios, states


@pytest.mark.slow
@pytest.mark.parametrize("cpu_bf16", ["yes", "no"], ids=["bf16-kernel", "fp32-kernel"])
def test_inductor_stays_close_and_scales_follow_their_histories(monkeypatch, cpu_bf16) -> None:
    """Inductor's kernels round high-precision ops (layer norm, GELU, the cast's arithmetic) differently
    in the last bit, and how differs between CPUs. A cast turns such a difference into a change of one
    FP8 step only for a value within that distance of a rounding boundary; compounded over training
    steps, those flips become any difference at all (a fixed trajectory tolerance failed on another
    CPU). So each step is compared from the same state, against FP8's own error as the noise floor:
    FP8 moves every element by up to half a step (an rms of ~0.29 steps), a flip moves one element by a
    whole step, so the ratio is about sqrt(12 x the fraction of elements flipped). fp32 reassociation
    (~2**-20 relative) flips at most ~2**-15 of the elements of each cast (within 2**-20 of a boundary,
    E4M3's relative step being at least 2**-4); the bound 0.25 allows 0.5%, 160 times that, layer
    amplification included, and is still far below what a real fault gives
    (an output computed without FP8: 1; with wrong scales: more). Measured on an Intel Xeon: <= 1e-6.
    Run with either CPU GEMM kernel of the bf16 path (FP8TRAIN_CPU_BF16 forces the probe): the fp32
    kernel rounds its output to bf16 in a separate op, which inductor fuses into the next ones and
    must keep (inductor's emulate_precision_casts; without it: 0.57 on an AMD EPYC without bf16).
    """
    monkeypatch.setenv("FP8TRAIN_CPU_BF16", cpu_bf16)
    first_eager = _train(None, steps=1)["state"][0]
    ratios, states = _inductor_training(steps=8)
    assert max(ratios) <= 0.25, ratios
    # the compared steps share their state, so also check what the compiled step records against an
    # independent eager run: one step from the same start, every amax equal but for fp32 reassociation
    # and the odd flip it causes (within 2**-6), far less than a wrong or missed recording moves them
    for got, want in zip(states[0][0::3], first_eager[0::3]):
        assert torch.allclose(got, want, rtol=2**-6, atol=0)
    state = states[-1]
    # every scale is exactly fp8_max / amax of its own (max over the) history, where it has one
    for history, scale, fp8_max in zip(state[0::3], state[1::3], [448.0, 57344.0] * 3):
        amax = history.amax(dim=0)
        seen = amax > 0
        expected = torch.full_like(amax, fp8_max).div_(amax)
        assert seen.any() and torch.equal(scale[seen], expected[seen])


def _two_ranks(rank: int, world: int) -> dict:
    group = torch.distributed.new_group([0, 1])
    eager = _train(None, rank=rank, group=group)
    compiled = _train("aot_eager", rank=rank, group=torch.distributed.new_group([0, 1]))
    return {"eager": eager, "compiled": compiled}


@pytest.mark.multirank
def test_two_ranks_aot_eager_equals_eager_with_the_same_collectives() -> None:
    runs = run_ranks(_two_ranks, 2, timeout_s=240, pg_timeout_s=60)
    for out in runs:
        _assert_bitwise(out["compiled"], out["eager"])
        # one all-reduce per direction and step, launched at region exit and at the end of backward
        assert out["compiled"]["calls"] == out["eager"]["calls"] == [(1, 1)] * 4
    for step in range(4):  # the ranks reduced for real: they saw different data, and agree
        assert all(
            torch.equal(a, b)
            for a, b in zip(runs[0]["compiled"]["state"][step], runs[1]["compiled"]["state"][step])
        )
    assert not torch.equal(runs[0]["compiled"]["loss"][0], runs[1]["compiled"]["loss"][0])


# ---- CUDA graphs (mode="reduce-overhead") and GPU division, decided on the CPU --------------------------
PROTOCOL_OPS = ["fp8train::forward_scales", "fp8train::backward_scales", "fp8train::check_recipe_kind"]


def test_inductor_is_told_to_keep_the_protocol_ops_out_of_cuda_graphs() -> None:
    """Told when an FP8 call is traced (importing inductor's config at `import fp8train` would double its
    time): a freshly compiled FP8 module leaves the setting in force, whatever was there before."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    torch._dynamo.reset()
    fp8train.inspection.reset()
    seen = []

    def compiler(gm, example_inputs):
        seen.append(set(torch._inductor.config.custom_should_partition_ops))
        return make_boxed_func(gm.forward)

    with torch._inductor.config.patch(custom_should_partition_ops=[]):
        run = torch.compile(
            fp8train.Linear(32, 32), backend=aot_autograd(fw_compiler=compiler), fullgraph=True
        )
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            run(torch.randn(32, 32))
    assert seen and all(set(PROTOCOL_OPS) <= ops for ops in seen)


def test_constant_for_compile_marks_as_torch_does() -> None:
    """torch_internals.constant_for_compile sets what torch.compiler.assume_constant_result sets (the
    mark dynamo reads), without importing torch._dynamo."""
    from fp8train.torch_internals import constant_for_compile

    def ours():
        return 1

    def torchs():
        return 1

    constant_for_compile(ours)
    torch.compiler.assume_constant_result(torchs)
    marks = {k: v for k, v in vars(torchs).items()}
    assert marks and vars(ours) == marks


@pytest.mark.slow
def test_reduce_overhead_partitions_the_graph_around_every_protocol_op(monkeypatch) -> None:
    """Under mode="reduce-overhead" inductor captures a CUDA graph per partition of its graph; it splits
    the graph around CPU work and ops it was told about, not around Python side effects. Inductor runs
    here with every node taken for a GPU node (as on CUDA), and its decision on each protocol op is
    read: each one is a partition boundary (captured, its Python would be skipped at every replay)."""
    from torch._inductor import ir, scheduler

    decided = []
    should_partition = scheduler.Scheduler.should_partition

    def spy(self, node):
        with monkeypatch.context() as gpu:
            gpu.setattr(scheduler.BaseSchedulerNode, "is_gpu", lambda node: True)
            reason = should_partition(self, node)
        kernel = node.node
        if isinstance(kernel, ir.FallbackKernel) and kernel.op_overload is not None:
            if kernel.op_overload.namespace == "fp8train":
                decided.append((kernel.op_overload.name(), reason))
        return reason

    monkeypatch.setattr(scheduler.Scheduler, "should_partition", spy)
    torch._dynamo.reset()
    fp8train.inspection.reset()
    run = torch.compile(fp8train.Linear(32, 32), mode="reduce-overhead", fullgraph=True)
    # every graph scheduled here, not loaded from a cache; config.patch restores the settings (a
    # monkeypatch of a torch config module deletes the key on undo, breaking later compilations)
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            y = run(torch.randn(32, 32))
        y.square().mean().backward()
    assert {name for name, _ in decided} == set(PROTOCOL_OPS)
    assert all(reason == f"custom partition op: {name}.default" for name, reason in decided), decided


def test_fp8_calls_refuse_cuda_graph_capture(monkeypatch) -> None:
    """Where a CUDA graph would capture the protocol's Python (torch.cuda.graph around FP8 modules, or
    a torch whose inductor cannot be told to partition) the call refuses, naming the way out, rather
    than be skipped at every replay. The capture is simulated on the CPU."""
    from fp8train.amax import hooks as ops

    # torch's own capture query answered yes (no CUDA graph can be captured on the CPU): a fact, no setting
    monkeypatch.setattr(ops, "capturing_cuda_graph", lambda like: True)
    fp8train.inspection.reset()
    model = fp8train.Linear(32, 32)
    with pytest.raises(RuntimeError, match="captured into a CUDA graph.*mode='default'"):
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            model(torch.randn(32, 32))


def test_fp8_graphs_are_compiled_with_divisions_rounded_as_eager() -> None:
    """Triton's float32 `/` is approximate unless inductor's eager_numerics.division_rounding is set:
    it is in force when the forward and the backward graph of an FP8 module are compiled, so that
    current, block and NVFP4 scales (fp8_max / amax, 1 / scale) divide as eager ones on GPUs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    seen = []

    def compiler(gm, example_inputs):
        seen.append(torch._inductor.config.eager_numerics.division_rounding)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    fp8train.inspection.reset()
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    run = torch.compile(fp8train.Linear(32, 32), backend=backend, fullgraph=True)
    with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8CurrentScaling()):
        y = run(torch.randn(32, 32))
    y.square().mean().backward()
    assert seen == [True, True]


class _DivisionByConstantAsOnGpu(torch.utils._python_dispatch.TorchDispatchMode):
    """What inductor's GPU lowering makes of a division by a constant (a number or a constant-filled
    tensor): a multiplication by the reciprocal, rounded to the dividend's dtype."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.div.Tensor:
            a, b = args
            divisor = b if not isinstance(b, torch.Tensor) else b.flatten()[0].item()
            if not isinstance(b, torch.Tensor) or bool((b == divisor).all()):
                return a * torch.tensor(1.0 / divisor, dtype=a.dtype)
        return func(*args, **(kwargs or {}))


def test_quotients_by_the_format_maxima_round_as_eager_under_gpu_lowering() -> None:
    """MXFP8's E8M0 scale and NVFP4's block scale divide by a constant (448, 57344, 6), which inductor
    on GPUs turns into a multiplication by a rounded reciprocal: about half of all float32 quotients
    come out one ulp off, and an E8M0 scale whose quotient lies by a power of two moves a whole step.
    Every float32 in [1, 2) (for normal numbers the rounding depends on the mantissa only), divided
    under that lowering, equals the correctly rounded eager quotient."""
    from fp8train.numerics import microscaling

    a = (torch.arange(2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    for b in (6.0, 448.0, 57344.0):
        with _DivisionByConstantAsOnGpu():
            lowered = microscaling._true_div(a, b)
        assert torch.equal(lowered, a / torch.tensor(b)), b


def _constant_value(divisor) -> Optional[float]:
    """The value of a divisor that is a constant (a number, a constant-filled tensor), else None."""
    if not isinstance(divisor, torch.fx.Node):
        return float(divisor)
    fills = {
        torch.ops.aten.full.default: lambda node: node.args[1],
        torch.ops.aten.full_like.default: lambda node: node.args[1],
        torch.ops.aten.scalar_tensor.default: lambda node: node.args[0],
        torch.ops.aten.ones_like.default: lambda node: 1.0,
    }
    return float(fills[divisor.target](divisor)) if divisor.target in fills else None


def _float32_divisions_by_constants(recipe) -> list[str]:
    """The float32 divisions by a constant other than a power of two (whose reciprocal is exact) in
    the forward and backward graphs of an FP8 Linear's training step under `recipe`."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    found = []

    def compiler(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target in (torch.ops.aten.div.Tensor, torch.ops.aten.div.Scalar):
                value = _constant_value(node.args[1])
                inexact = value is not None and math.frexp(value)[0] != 0.5
                if inexact and node.meta["val"].dtype == torch.float32:
                    found.append(node.format_node())
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    fp8train.inspection.reset()
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    run = torch.compile(fp8train.Linear(32, 32), backend=backend, fullgraph=True)
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        y = run(torch.randn(32, 32))
    y.square().mean().backward()
    return found


@pytest.mark.parametrize(
    "recipe",
    [
        fp8train.Float8CurrentScaling(),
        pytest.param(fp8train.Float8BlockScaling(), marks=pytest.mark.slow),
        pytest.param(fp8train.MXFP8BlockScaling(), marks=pytest.mark.slow),
        pytest.param(fp8train.NVFP4BlockScaling(), marks=pytest.mark.slow),
    ],
    ids=lambda recipe: type(recipe).__name__,
)
def test_no_float32_division_by_a_constant_in_fp8_graphs(recipe) -> None:
    """Inductor on GPUs lowers a division by a constant to a multiplication by a rounded reciprocal,
    which the division-rounding setting does not cover: no float32 scale arithmetic of the traced
    graphs divides by one (the quotients by the format maxima are taken in float64, see above)."""
    assert _float32_divisions_by_constants(recipe) == []

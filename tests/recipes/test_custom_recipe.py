"""A user's own stateless recipe, defined here and registered with `fp8train.register_recipe`: no edit
of the library, and every door of fp8train takes it (docs/guide.md, "Your own recipe"; design.md,
section 9). The toy is current scaling with headroom: each tensor's scale times 3/4 (not a power of
two, so its FP8 values differ from current scaling's and the tests can tell the two apart)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fp8train
from fp8train.numerics.formats import Format, fp8_max
from fp8train.quantization import RECIPES, quantization_of
from fp8train.quantization.base import GradOperands, InputOperands, Quantization, WeightOperands
from fp8train.quantization.current import current_scales
from fp8train.quantization.delayed import DelayedQuantization
from fp8train.quantization.per_tensor import TensorQuantization
from fp8train.tools import cli

HEADROOM = 0.75


@dataclasses.dataclass(frozen=True)
class HeadroomScaling:
    """Toy: current scaling with each scale times 3/4 (a quarter of the range left free)."""

    fp8_format: Format = Format.HYBRID


def _scales(t: torch.Tensor, encoding: str):
    scale, _ = current_scales(t, encoding)
    scale = scale * HEADROOM
    return scale, scale.reciprocal()


class HeadroomQuantization(TensorQuantization):
    kind = "headroom"  # kernel: "tensorwise", from TensorQuantization
    made = 0  # how many were made: one per recipe checked at a door (quantization_of)

    def __init__(self, recipe) -> None:
        super().__init__(recipe)
        type(self).made += 1

    def quantize_weight(self, weight, call) -> WeightOperands:
        return WeightOperands.same(self.cast(weight, *_scales(weight, "e4m3"), "e4m3", call.operand_dtype))

    def quantize_input(self, x2d, call) -> InputOperands:
        operand = self.cast(x2d, *_scales(x2d, "e4m3"), "e4m3", call.operand_dtype)
        return InputOperands(operand, operand)

    def quantize_grad(self, g2d, call, needs) -> GradOperands:
        return self.grad_operands(g2d, *_scales(g2d, self.grad_encoding), call)


def mean_of_history(history: torch.Tensor) -> torch.Tensor:
    """The amax a scale is computed from: the mean of each role's history (delayed scaling: the max)."""
    return history.mean(dim=0)


@dataclasses.dataclass(frozen=True)
class MeanHistoryScaling(fp8train.DelayedScaling):
    """Toy stateful recipe: delayed scaling's state and reduction, its amax the history's mean."""

    amax_history_len: int = 4
    amax_compute_algo: object = mean_of_history


class MeanHistoryQuantization(DelayedQuantization):
    kind = "mean_history"


@pytest.fixture(scope="module", autouse=True)
def registered():
    fp8train.register_recipe(HeadroomScaling, HeadroomQuantization)
    fp8train.register_recipe(MeanHistoryScaling, MeanHistoryQuantization)
    yield
    del RECIPES[HeadroomScaling], RECIPES[MeanHistoryScaling]  # the registry the rest of the suite expects


def _quantized(t: torch.Tensor) -> torch.Tensor:
    """The toy's rule written out: saturate(t * 3/4 * 448 / amax) in E4M3, back in float64."""
    scale = torch.tensor(448.0, dtype=torch.float32) / t.abs().amax().float() * HEADROOM
    q = (t.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.double() / scale.double()


def _forward(recipe, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        return module(x)


def test_fp8_autocast_trains_with_the_users_quantization(monkeypatch) -> None:
    monkeypatch.setenv("FP8TRAIN_GEMM", "fp32")  # the exact emulation: FP8 products summed in fp32
    torch.manual_seed(0)
    module = fp8train.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    y = _forward(HeadroomScaling(), x, module)
    y.float().pow(2).mean().backward()
    expected = _quantized(x.detach()) @ _quantized(module.weight.detach()).T + module.bias.detach().double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    twin = fp8train.Linear(64, 32)  # the same weights, not yet trained under any kind
    twin.load_state_dict({k: v for k, v in module.state_dict().items() if k != "_extra_state"}, strict=False)
    current = _forward(fp8train.Float8CurrentScaling(), x.detach(), twin)
    assert not torch.equal(current, y)  # current scaling's FP8 values are not the toy's
    assert module.recipe_kind == "headroom" and x.grad is not None and module.weight.grad is not None


def test_state_dict_records_the_users_kind() -> None:
    module = fp8train.Linear(32, 16)
    _forward(HeadroomScaling(), torch.randn(8, 32), module).sum().backward()
    fresh = fp8train.Linear(32, 16)
    fresh.load_state_dict(module.state_dict())
    assert fresh.recipe_kind == "headroom"
    with pytest.raises(RuntimeError, match="trained with headroom scaling"):
        _forward(fp8train.Float8CurrentScaling(), torch.randn(8, 32), fresh)
    _forward(HeadroomScaling(), torch.randn(8, 32), fresh).sum().backward()  # its own kind trains on


def test_prepare_convert_and_coverage_take_it_and_prepare_checks_it_once() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    before = HeadroomQuantization.made
    prepared = fp8train.prepare(model, recipe=HeadroomScaling(), verbose=False)
    for _ in range(3):
        prepared(torch.randn(16, 64)).sum().backward()
    # the recipe is checked once, where it comes in: one record object made for prepare and its regions
    assert HeadroomQuantization.made - before == 1
    assert [m.recipe_kind for m in model.modules() if isinstance(m, fp8train.FP8Module)] == ["headroom"] * 2
    report = fp8train.coverage(prepared)  # a prepared model's recipe
    assert report.recipe_kind == "headroom" and report.counts()["fp8"] == 2
    assert {layer.path for layer in report.layers} == {
        fp8train.numerics.gemm.choose_path(torch.device("cpu"), 16, 64, 64)
    }
    assert not any(layer.padded for layer in report.layers)  # block None: scales cover whole tensors

    converted = fp8train.convert_to_fp8(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 24)),
        recipe=HeadroomScaling(),
        log=False,
    )
    assert [isinstance(m, fp8train.FP8Module) for m in converted] == [True, False]  # 24: off 16
    assert (
        "recipe headroom); high precision: 1 shape"
        in fp8train.coverage(converted, HeadroomScaling()).summary()
    )


def test_torch_compile_runs_it_as_eager_does() -> None:
    torch.manual_seed(0)
    module = fp8train.Linear(64, 32)
    x = torch.randn(16, 64)
    eager = _forward(HeadroomScaling(), x, module)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(_forward(HeadroomScaling(), x, compiled), eager, rtol=0, atol=0)


def test_fp8train_info_lists_it(monkeypatch, capsys) -> None:
    monkeypatch.delenv("FP8TRAIN_GEMM", raising=False)
    monkeypatch.delenv("NVTE_ASYNC_AMAX_REDUCTION", raising=False)
    assert cli.main(["info"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  HeadroomScaling: ")]
    current = fp8train.numerics.gemm.recipe_gemm("tensorwise", torch.device("cpu"))
    assert lines == [f"  HeadroomScaling: {current[0]}: {current[1]}"] or torch.cuda.is_available()


def _record(**facts) -> type:
    """A Quantization subclass with the toy's methods and these class attributes."""
    return type("Toy", (HeadroomQuantization,), facts)


@pytest.mark.parametrize(
    "config, quantization, named",
    [
        (HeadroomScaling, _record(), "registered already"),
        (dataclasses.dataclass(type("Loose", (), {})), _record(kind="loose"), "must be frozen"),
        (type("Plain", (), {}), _record(kind="plain"), "must be a dataclass"),
        (
            dataclasses.dataclass(frozen=True)(type("A", (), {})),
            _record(kind="current"),
            "kind 'current' is taken",
        ),
        (dataclasses.dataclass(frozen=True)(type("B", (), {})), _record(kind="b c"), "`kind`"),
        (
            dataclasses.dataclass(frozen=True)(type("C", (), {})),
            _record(kind="c", kernel="rowwise"),
            "`kernel`",
        ),
        (dataclasses.dataclass(frozen=True)(type("D", (), {})), _record(kind="d", block=0), "`block`"),
        (
            dataclasses.dataclass(frozen=True)(type("E", (), {})),
            _record(kind="e", whole_blocks=None),
            "`whole_blocks`",
        ),
        (
            dataclasses.dataclass(frozen=True)(type("F", (), {})),
            _record(kind="f", reduces_amax=True),
            "reduces amaxes",
        ),
        (dataclasses.dataclass(frozen=True)(type("G", (), {})), torch.nn.Linear, "subclass of"),
        (
            dataclasses.dataclass(frozen=True)(type("H", (), {})),
            type(
                "H",
                (Quantization,),
                {"kind": "h", "kernel": "tensorwise", "quantize_weight": lambda s, w, c: None},
            ),
            "override quantize_input, quantize_grad",
        ),
        (
            dataclasses.dataclass(frozen=True)(type("I", (), {})),
            type(
                "I", (Quantization,), {"quantize_weight": None, "quantize_input": None, "quantize_grad": None}
            ),
            "set the class attribute `kind`",
        ),
    ],
)
def test_registration_refuses_an_incomplete_record_naming_the_fact(config, quantization, named) -> None:
    registry = dict(RECIPES)
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        fp8train.register_recipe(config, quantization)
    assert RECIPES == registry  # nothing half-registered


def test_an_unregistered_recipe_is_refused_at_every_door_with_the_fix() -> None:
    unregistered = dataclasses.dataclass(frozen=True)(type("Unregistered", (), {}))()
    for door in (
        lambda: fp8train.fp8_autocast(fp8_recipe=unregistered).__enter__(),
        lambda: fp8train.prepare(torch.nn.Linear(16, 16), recipe=unregistered),
        lambda: fp8train.convert_to_fp8(torch.nn.Linear(16, 16), recipe=unregistered),
        lambda: fp8train.coverage(torch.nn.Linear(16, 16), unregistered),
        lambda: quantization_of(unregistered),
    ):
        with pytest.raises(
            ValueError,
            match=r"registered with fp8train.register_recipe \(HeadroomScaling, MeanHistoryScaling\)",
        ):
            door()


def _trained(recipe) -> fp8train.Linear:
    torch.manual_seed(0)
    module = fp8train.Linear(32, 16)
    for step in range(3):
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            y = module(torch.randn(8, 32) * (step + 1))  # growing amaxes: the mean and the max differ
        y.sum().backward()
    return module


def test_a_stateful_recipe_reuses_delayed_scalings_state_and_reduction_through_its_hooks() -> None:
    """A subclass of DelayedScaling with its own kind: amax/ keeps its histories and reduces them as
    delayed scaling's, and computes its scales through the hook (`amax_compute_algo`)."""
    mean = _trained(MeanHistoryScaling())
    same_hook = _trained(fp8train.DelayedScaling(amax_history_len=4, amax_compute_algo=mean_of_history))
    plain = _trained(fp8train.DelayedScaling(amax_history_len=4))
    assert (mean.recipe_kind, same_hook.recipe_kind) == ("mean_history", "delayed")
    for key in ("scaling_fwd", "scaling_bwd"):
        meta = mean.fp8_meta[key]
        assert torch.equal(meta.amax_history, same_hook.fp8_meta[key].amax_history)
        assert torch.equal(meta.scale, same_hook.fp8_meta[key].scale)
        assert not torch.equal(meta.scale, plain.fp8_meta[key].scale)
        amax = meta.amax_history.mean(dim=0)
        seen = amax > 0
        encoding = (
            MeanHistoryScaling().fp8_format.fwd
            if key == "scaling_fwd"
            else MeanHistoryScaling().fp8_format.bwd
        )
        assert seen.any()
        torch.testing.assert_close(meta.scale[seen], fp8_max(encoding) / amax[seen])  # margin 0
    fwd = mean.fp8_meta["scaling_fwd"]
    assert fwd.amax_history[0, 0] > fwd.amax_history[1, 0] > fwd.amax_history[2, 0] > 0  # three steps kept
    with pytest.raises(RuntimeError, match="trained with mean_history scaling"):
        with fp8train.fp8_autocast(fp8_recipe=fp8train.DelayedScaling(amax_history_len=4)):
            mean(torch.randn(8, 32))


# ---- a stateful recipe with a state of its own, through the runtime's hooks (design.md, section 3.1) -------
class RunningMaxState:
    """Toy state (a `runtime.RecipeState`): per (module handle, GEMM, role) the running max of every
    amax seen in earlier regions and backward passes; a region's amaxes apply when the runtime says it
    exited, a backward pass's when it says it ended (delayed: a step casts with earlier steps' maxima)."""

    process_group = None  # this rank alone

    def __init__(self) -> None:
        self.maxima: dict[tuple, torch.Tensor] = {}
        self.pending: dict[tuple, torch.Tensor] = {}
        self.latest_region = None
        self.indices = 0
        self.exits: list[int] = []  # serials of the regions the runtime said exited
        self.backward_ends = 0

    def next_region_index(self) -> int:
        self.indices += 1
        return self.indices - 1

    def _apply(self) -> None:
        for key, amax in self.pending.items():
            self.maxima[key] = torch.maximum(self.maxima.get(key, amax), amax)
        self.pending.clear()

    def exited(self, region, failed: bool) -> None:
        self.exits.append(region.serial)
        self.latest_region = region
        self._apply()

    def backward_ended(self, region) -> None:
        self.backward_ends += 1
        self._apply()

    def scale(self, key: tuple, t: torch.Tensor, encoding: str) -> torch.Tensor:
        """Its scale from earlier maxima (1 before any), and the tensor's amax noted for later."""
        amax = t.detach().abs().amax().float()
        self.pending[key] = torch.maximum(self.pending.get(key, amax), amax)
        seen = self.maxima.get(key)
        return torch.tensor(1.0) if seen is None else fp8_max(encoding) / seen


RUNNING = RunningMaxState()


@dataclasses.dataclass(frozen=True)
class RunningMaxScaling:
    """Toy stateful recipe: each tensor scaled from the running max of its amaxes in earlier steps."""

    fp8_format: Format = Format.HYBRID


class RunningMaxQuantization(TensorQuantization):
    kind = "running_max"

    # the runtime's hooks (runtime.RecipeRuntime): its state for a region, a call's plan
    def region_state(self, settings, region, fp8_group) -> RunningMaxState:
        return RUNNING

    def plan_call(self, module, settings, region, training):
        if settings.enabled and training:
            region.note_trained(settings.state)  # the region's exit is owed to the state
        return fp8train.runtime.ForwardPlan(True, self, record=training) if settings.enabled else None

    def call_scales(self, call, x, weight_amax):
        plan = call.plan  # no scales to hand down; the token names the region to the GEMM's backward
        token = None if plan is None or plan.region is None else plan.region.token
        return None, token

    def _key(self, call, role: str) -> tuple:
        return int(call.module_handle), call.gemm_index, role

    def quantize_weight(self, weight, call) -> WeightOperands:
        scale = RUNNING.scale(self._key(call, "w"), weight, "e4m3")
        return WeightOperands.same(self.cast(weight, scale, scale.reciprocal(), "e4m3", call.operand_dtype))

    def quantize_input(self, x2d, call) -> InputOperands:
        scale = RUNNING.scale(self._key(call, "x"), x2d, "e4m3")
        operand = self.cast(x2d, scale, scale.reciprocal(), "e4m3", call.operand_dtype)
        return InputOperands(operand, operand)

    def quantize_grad(self, g2d, call, needs) -> GradOperands:
        region = fp8train.runtime.STATE.regions.by_serial(int(call.token))
        fp8train.runtime.STATE.backward.current().note(RUNNING, region)  # the pass's end is owed to it
        scale = RUNNING.scale(self._key(call, "g"), g2d, self.grad_encoding)
        return self.grad_operands(g2d, scale, scale.reciprocal(), call)


def test_a_stateful_recipe_with_its_own_state_runs_through_the_runtimes_hooks(monkeypatch) -> None:
    """No edit of the library: the runtime tells the toy's state when each region exits and each
    backward pass ends, and each step casts with the maxima of the steps before it."""
    monkeypatch.setenv("FP8TRAIN_GEMM", "fp32")  # the exact emulation: FP8 products summed in fp32
    fp8train.register_recipe(RunningMaxScaling, RunningMaxQuantization)
    try:
        torch.manual_seed(0)
        module = fp8train.Linear(32, 16)
        w = module.weight.detach()
        xs = [torch.randn(8, 32) * scale for scale in (1.0, 4.0, 2.0)]
        outputs = []
        for x in xs:
            with fp8train.fp8_autocast(fp8_recipe=RunningMaxScaling()):
                y = module(x)
            y.sum().backward()  # no optimizer step: the weight stays w
            outputs.append(y.detach())
    finally:
        del RECIPES[RunningMaxScaling]
    assert len(RUNNING.exits) == 3 and RUNNING.backward_ends == 3 and module.recipe_kind == "running_max"

    def quantized(t: torch.Tensor, scale) -> torch.Tensor:
        q = (t.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q.double() / torch.as_tensor(scale).double()

    for step, (x, y) in enumerate(zip(xs, outputs)):
        x_scale = 1.0 if step == 0 else 448.0 / max(float(v.abs().amax()) for v in xs[:step])
        w_scale = 1.0 if step == 0 else 448.0 / float(w.abs().amax())
        expected = quantized(x, x_scale) @ quantized(w, w_scale).T + module.bias.detach().double()
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)

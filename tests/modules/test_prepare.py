"""`fp8train.prepare`: one call, then any caller of the model trains in FP8.

Each check compares against what the docs say `prepare` is equivalent to: the same model converted
with `convert_to_fp8` and called inside a hand-written `fp8_autocast` region. Equality is bitwise
(same operations in the same order), so a prepared forward that ran outside a region, under another
recipe, or twice in one region would fail it.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch

import fp8train
from fp8train.inspection import amax_groups, counters

RECIPE = fp8train.DelayedScaling(amax_history_len=4)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(32, 64)
        self.odd = torch.nn.Linear(64, 10)  # 10 is not a multiple of 16: stays high precision
        self.mid = torch.nn.Linear(64, 32)
        self.last = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = torch.relu(self.first(x))
        return self.last(torch.relu(self.mid(h))) * scale + self.odd(h).sum(-1, keepdim=True)


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)


def _train(model, steps: int, region: bool) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        if region:
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                out = model(x)
        else:
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    fp8train.synchronize()
    return losses


def _fp8_state(model) -> list[torch.Tensor]:
    out = []
    for m in model.modules():
        if isinstance(m, fp8train.FP8Module):
            for key in ("scaling_fwd", "scaling_bwd"):
                meta = m.fp8_meta[key]
                out += [meta.amax_history.clone(), meta.scale.clone()]
    return out


def test_prepared_model_trains_as_the_hand_written_region() -> None:
    reference = fp8train.convert_to_fp8(_net())
    ref_losses = _train(reference, 4, region=True)
    fp8train.inspection.reset()
    prepared = fp8train.prepare(_net(), recipe=RECIPE)
    assert isinstance(prepared.first, fp8train.Linear) and type(prepared.odd) is torch.nn.Linear
    losses = _train(prepared, 4, region=False)  # no region in the loop: prepare supplies it
    assert losses == ref_losses
    state, ref_state = _fp8_state(prepared), _fp8_state(reference)
    assert all(torch.equal(a, b) for a, b in zip(state, ref_state))
    history = prepared.first.fp8_meta["scaling_fwd"].amax_history
    assert history[:, :2].gt(0).all(), "FP8 casts recorded amaxes in every step"
    # one region per call: 4 training regions of the one amax group
    (group,) = amax_groups()
    assert group.training_regions == 4


def test_prepare_twice_is_an_error_and_bad_input_says_what_to_do() -> None:
    model = fp8train.prepare(_net())
    with pytest.raises(ValueError, match="already been prepared"):
        fp8train.prepare(model)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fp8train.prepare(lambda x: x)
    with pytest.raises(ValueError, match="no layer to train in FP8"):
        fp8train.prepare(torch.nn.Sequential(torch.nn.Linear(10, 10)))
    with pytest.raises(ValueError, match="recipe must be"):
        fp8train.prepare(_net(), recipe="delayed")


def test_state_dict_signature_and_filters() -> None:
    plain = _net()
    keys = set(plain.state_dict())
    model = fp8train.prepare(_net())
    extra = {f"{n}._extra_state" for n in ("first", "mid", "last")}
    assert set(model.state_dict()) == keys | extra
    assert inspect.signature(model.forward) == inspect.signature(plain.forward)
    ends = fp8train.prepare(_net(), module_filter_fn=fp8train.first_and_last_linear_filter(_net()))
    assert type(ends.first) is torch.nn.Linear and type(ends.last) is torch.nn.Linear
    assert isinstance(ends.mid, fp8train.Linear)


def test_evaluation_under_no_grad_launches_no_reduction() -> None:
    model = fp8train.prepare(_net(), recipe=RECIPE)
    _train(model, 2, region=False)
    (group,) = amax_groups()
    state, stats = _fp8_state(model), counters()
    with torch.no_grad():
        for step in range(3):
            model(_batch(step)[0])
    fp8train.synchronize()
    assert group.training_regions == 2  # the evaluation regions did not count as steps
    assert counters() == stats and all(torch.equal(a, b) for a, b in zip(_fp8_state(model), state))
    # (on several ranks: no collective either, tests/hosts/test_integration_hf.py counts them)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_before_and_after_a_step_are_prepared_models_of_their_own(how: str) -> None:
    def clone(m):
        if how == "deepcopy":
            return copy.deepcopy(m)
        if how == "pickle":
            return pickle.loads(pickle.dumps(m))
        buffer = io.BytesIO()
        torch.save(m, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    model = fp8train.prepare(_net(), recipe=RECIPE)
    fresh = clone(model)  # before any step
    assert fp8train.is_prepared(fresh) and fresh.forward.module is fresh
    _train(model, 2, region=False)
    trained = clone(model)  # after a step: carries the FP8 state
    assert fp8train.is_prepared(trained) and trained.forward.module is trained
    assert all(torch.equal(a, b) for a, b in zip(_fp8_state(trained), _fp8_state(model)))
    with torch.no_grad():
        x = _batch(9)[0]
        assert torch.equal(trained(x), model(x))  # the copy's forward is the copy's, in FP8
    # the copy trains in FP8 on its own; the original's state does not move
    before = _fp8_state(model)
    _train(trained, 1, region=False)
    assert all(torch.equal(a, b) for a, b in zip(_fp8_state(model), before))
    assert not torch.equal(trained.first.fp8_meta["scaling_fwd"].amax_history, before[0])


def test_torch_compile_of_a_prepared_model_matches_eager() -> None:
    eager = fp8train.prepare(_net(), recipe=RECIPE)
    eager_losses = _train(eager, 3, region=False)
    fp8train.inspection.reset()
    model = fp8train.prepare(_net(), recipe=RECIPE)
    compiled = torch.compile(model, backend="aot_eager")
    losses = _train(compiled, 3, region=False)
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(_fp8_state(model), _fp8_state(eager)))


def test_transformers_models_give_their_fp8_state_as_a_tensor_and_either_form_loads() -> None:
    """save_pretrained writes safetensors (tensors only): a prepared transformers model gives its FP8
    state as a uint8 tensor of the same bytes; bytes and tensor forms load into any FP8 module."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
    hf = fp8train.prepare(transformers.GPT2LMHeadModel(config))
    hf_extra = {k: v for k, v in hf.state_dict().items() if k.endswith("_extra_state")}
    assert hf_extra and all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in hf_extra.values())
    plain = fp8train.prepare(_net(), recipe=RECIPE)
    _train(plain, 2, region=False)
    as_bytes = plain.state_dict()
    assert isinstance(as_bytes["first._extra_state"], bytes)
    plain.first.extra_state_as_tensor = True
    as_tensor = plain.first.state_dict()["_extra_state"]
    assert bytes(as_tensor.tolist()) == as_bytes["first._extra_state"]
    for form in (as_bytes["first._extra_state"], as_tensor):
        target = fp8train.prepare(_net(1), recipe=RECIPE)
        target.first.load_state_dict(
            {"weight": target.first.weight, "bias": target.first.bias, "_extra_state": form}
        )
        assert all(torch.equal(a, b) for a, b in zip(_fp8_state(target)[:4], _fp8_state(plain)[:4]))


def test_a_copy_keeps_an_explicit_group_in_process_and_pickling_refuses_it() -> None:
    """A process group does not pickle: silently reducing an unpickled copy over the world instead
    would mix unrelated ranks' amaxes, so pickling says what to do; deepcopy (same process) keeps it."""
    group = object()  # stands for a process group: only identity matters here (no step is run)
    model = fp8train.prepare(_net(), recipe=RECIPE, amax_reduction_group=group)
    assert copy.deepcopy(model).forward.group is group
    with pytest.raises(TypeError, match="explicit amax_reduction_group cannot be pickled.*state_dict"):
        pickle.dumps(model)


def test_accelerate_mixed_precision_unwrap_keeps_the_fp8_forward() -> None:
    """accelerate (mixed precision) wraps `model.forward` and, on unwrap_model(keep_fp32_wrapper=False),
    rebinds the original as MethodType(forward, model): the FP8 forward must take that rebinding."""
    accelerate = pytest.importorskip("accelerate")
    model = fp8train.prepare(_net(), recipe=RECIPE)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    wrapped = accelerator.prepare(model)
    x = _batch(0)[0]
    with torch.no_grad():
        autocast_out = wrapped(x)
    unwrapped = accelerator.unwrap_model(wrapped, keep_fp32_wrapper=False)
    with torch.no_grad():
        out = unwrapped(x)  # raised TypeError (the model passed twice) before
    assert out.dtype == torch.float32 and autocast_out.shape == out.shape
    losses = _train(unwrapped, 2, region=False)  # and it still trains in FP8
    assert all(torch.isfinite(torch.tensor(losses)))
    assert unwrapped.first.fp8_meta["scaling_fwd"].amax_history.abs().sum() > 0


def test_an_ema_copy_of_a_trained_prepared_model_averages_and_evaluates_in_fp8() -> None:
    """torch.optim.swa_utils.AveragedModel deep-copies the model: the copy is prepared on its own (its
    forward runs the copy), averages the original's weights, and leaves the original training on."""
    model = fp8train.prepare(_net(), recipe=RECIPE)
    _train(model, 2, region=False)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5)
    )
    assert fp8train.is_prepared(ema.module) and ema.module.forward.module is ema.module
    ema.update_parameters(model)  # the first update copies
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, 1, region=False)
    ema.update_parameters(model)  # then averages
    for averaged, old, new in zip(ema.module.parameters(), before, model.parameters()):
        assert torch.allclose(averaged, 0.5 * old + 0.5 * new.detach())
    x = _batch(3)[0]
    with torch.no_grad():
        out, high = ema(x), type(ema.module).forward(ema.module, x)  # in FP8 vs the class's own forward
    assert out.shape == high.shape and not torch.equal(out, high)

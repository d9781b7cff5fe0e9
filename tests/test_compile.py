"""torch.compile on a model with fp8train modules (torch 2.13, CPU).

Eager is the supported mode. Under torch.compile the FP8 modules are excluded from graphs (their
forward is wrapped with torch.compiler.disable): the compiled model graph-breaks around them and they
run eagerly, so results equal eager. Without that, tracing the region bookkeeping failed after about a
minute with an internal dynamo AssertionError ("sources must not be empty for symbol ..."). With
fullgraph=True, compilation fails with torch's "Unsupported" error, which carries fp8train's reason.
"""

from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.modules.base import EAGER_REASON
from fp8train.protocol import REGISTRY

RECIPE = fp8train.DelayedScaling(amax_history_len=4)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(fp8train.Linear(32, 32), torch.nn.GELU(), fp8train.LayerNormMLP(32, 64))


def _train(compile_kwargs, autocast_inside: bool) -> list[torch.Tensor]:
    """Three steps with growing inputs (the scales move); losses, grads and FP8 state."""
    REGISTRY.__init__()
    model = _model()

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        if autocast_inside:
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                return torch.tanh(model(x)).pow(2).mean()
        return torch.tanh(model(x)).pow(2).mean()

    step = torch.compile(loss_fn, **compile_kwargs) if compile_kwargs is not None else loss_fn
    out = []
    for i in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) * (1 + i)
        if autocast_inside:
            loss = step(x)
        else:
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                loss = step(x)
        loss.backward()
        out += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
    fp8train.synchronize()
    for m in (model[0], model[2]):
        for key in ("scaling_fwd", "scaling_bwd"):
            out += [m.fp8_meta[key].amax_history.clone(), m.fp8_meta[key].scale.clone()]
    return out


@pytest.mark.parametrize("autocast_inside", [False, True])
def test_compiled_model_equals_eager(autocast_inside: bool) -> None:
    """aot_eager runs dynamo and AOTAutograd without a code generator: results must be bitwise eager's."""
    eager = _train(None, autocast_inside)
    torch._dynamo.reset()
    compiled = _train({"backend": "aot_eager"}, autocast_inside)
    assert len(eager) == len(compiled)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert not torch.equal(eager[-4], torch.ones_like(eager[-4]))  # FP8 really ran: scales moved


def test_inductor_compiles_around_fp8_modules() -> None:
    """The default backend generates code for the non-FP8 ops; those may round differently, so: close."""
    eager = _train(None, False)
    torch._dynamo.reset()
    compiled = _train({}, False)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(eager, compiled))


def test_fullgraph_fails_with_the_reason() -> None:
    """fullgraph=True cannot hold an FP8 module: torch raises, and its message carries fp8train's reason.

    (Also when the first call of a module is a traced one: the wrapper then raises EAGER_REASON
    itself, which dynamo reports; without fullgraph it falls back to eager for that frame.)
    """
    import torch._dynamo  # noqa: F401  (loaded by torch.compile anyway)

    model = _model()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        with pytest.raises(Exception, match="fp8train FP8 modules run eagerly") as info:
            compiled(torch.randn(8, 32))
    assert "fullgraph=True" in str(info.value) and EAGER_REASON in str(info.value)

"""convert_to_fp8: in-place swap of linear layers, on hand-made models and on a real transformers GPT-2."""

from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.convert import Conv1D, convert_to_fp8

RECIPE = fp8train.DelayedScaling(amax_history_len=4)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.odd = torch.nn.Linear(32, 24)  # 24 is not a multiple of 16: skipped by default
        self.down = torch.nn.Linear(24, 16, bias=False)  # in_features 24: skipped as well
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.odd(self.up(x)))))


def test_convert_swaps_in_place_and_keeps_parameters() -> None:
    torch.manual_seed(0)
    shared = torch.nn.Linear(32, 32)
    model = torch.nn.ModuleDict(
        {"a": Block(), "b": torch.nn.Sequential(shared, torch.nn.ReLU(), shared), "c": shared}
    ).to(torch.bfloat16)
    before = dict(model.named_parameters(remove_duplicate=False))
    names = []

    def skip_heads(module: torch.nn.Module, fqn: str) -> bool:
        names.append(fqn)
        return not fqn.endswith("head")

    out = convert_to_fp8(model, module_filter_fn=skip_heads)
    assert out is model
    assert type(model["a"].up) is fp8train.Linear
    assert type(model["a"].odd) is torch.nn.Linear and type(model["a"].down) is torch.nn.Linear
    assert type(model["a"].head) is torch.nn.Linear  # filtered out
    # the shared layer became one FP8 module, still shared by its three parents
    assert type(shared) is torch.nn.Linear and type(model["c"]) is fp8train.Linear
    assert model["b"][0] is model["b"][2] is model["c"]
    # the filter saw every linear layer, each once (asked first: what it keeps is kept at the user's
    # request, whatever the shape, and not warned about)
    assert sorted(names) == ["a.down", "a.head", "a.odd", "a.up", "c"]
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert all(p.dtype == torch.bfloat16 for p in after.values())


def test_convert_root_linear_and_bad_arguments() -> None:
    lin = torch.nn.Linear(16, 16)
    new = convert_to_fp8(lin)
    assert type(new) is fp8train.Linear and new.weight is lin.weight and new.bias is lin.bias
    assert convert_to_fp8(lin, module_filter_fn=lambda m, fqn: False) is lin
    with pytest.raises(ValueError, match="DelayedScaling"):
        convert_to_fp8(lin, recipe="hybrid")
    with pytest.raises(ValueError, match="callable"):
        convert_to_fp8(lin, module_filter_fn="lm_head")


def _gpt2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_converted_matches_outside_fp8_region() -> None:
    """GPT-2's Conv1D layers become FP8 modules on the same (in x out) weights; high precision unchanged."""
    model = _gpt2()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    ref_loss = model(ids, labels=ids).loss
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    before = dict(model.named_parameters())
    convert_to_fp8(model, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    block = model.transformer.h[0]
    for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
        assert type(layer) is Conv1D
    assert type(model.lm_head) is torch.nn.Linear  # filtered
    assert all(p is before[n] for n, p in model.named_parameters())
    for region in (None, fp8train.fp8_autocast(enabled=False, fp8_recipe=RECIPE)):
        if region is None:
            loss = model(ids, labels=ids).loss
        else:
            with region:
                loss = model(ids, labels=ids).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    # inside an FP8 region it really runs in FP8: close to, but not equal to, high precision
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        fp8_loss = model(ids, labels=ids).loss
    assert not torch.equal(fp8_loss, ref_loss)
    assert abs(fp8_loss.item() - ref_loss.item()) < 0.05 * ref_loss.item()


def test_gpt2_trains_under_fp8() -> None:
    """20 Adam steps on one batch: the FP8 loss falls like the high-precision one and the scales move."""

    def train(fp8: bool) -> tuple[list[float], torch.nn.Module]:
        model = _gpt2()
        convert_to_fp8(model)  # the tied lm_head too: it keeps the embedding's Parameter
        assert model.lm_head.weight is model.transformer.wte.weight
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(20):
            with fp8train.fp8_autocast(enabled=fp8, fp8_recipe=RECIPE):
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        fp8train.synchronize()
        return losses, model

    fp8_losses, model = train(True)
    hp_losses, _ = train(False)
    assert fp8_losses[-1] < 0.6 * fp8_losses[0]
    assert all(abs(a - b) < 0.05 * b for a, b in zip(fp8_losses, hp_losses))
    assert fp8_losses != hp_losses
    meta = model.transformer.h[0].mlp.c_fc.fp8_meta
    assert bool((meta["scaling_fwd"].scale[:2] != 1).all())
    assert bool((meta["scaling_bwd"].scale[:1] != 1).all())
    assert int((meta["scaling_fwd"].amax_history[:, 0] > 0).sum()) == RECIPE.amax_history_len

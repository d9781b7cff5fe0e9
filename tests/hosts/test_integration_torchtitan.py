"""torchtitan: `FP8TrainConverter` against torchtitan's own model configs and modules (llama3's
smallest flavour, "debugmodel"), on the CPU, in one process.

torchtitan (0.3) runs more than one rank only on GPUs, and on a CPU-only torch its models package
needs triton to import. scripts/setup.sh installs torchtitan with the packages its models import
(triton included) and without those of its trainer (datasets, wandb), so the tests below run in
the suite; only the last (torchtitan's ConfigManager, which imports its data loading) skips there.
The GPU recipe is in docs/guide.md. What is checked here:

- config level: every eligible `Linear.Config` (30 in debugmodel) becomes an `FP8Linear.Config`,
  the output head (`lm_head`) stays torchtitan's Linear, the root is still an instance of its own
  config class; converting twice, or a filter that leaves nothing, is an error;
- module level: built on the meta device and initialised by torchtitan (`to_empty`,
  `init_states`) the converted model has the unconverted model's parameters (same seed, same
  values), its state_dict keys plus FP8 extra state, and the Module protocol; outside an FP8 region
  it computes bit for bit what the unconverted model does, and its own forward is one FP8 region
  (its output differs from high precision, by FP8 rounding only);
- training: forward/backward steps of the whole converted debugmodel train in FP8 (every
  converted layer records input, weight and gradient amaxes; one region per step; the loss falls),
  and so does torchtitan's FeedForward block converted on its own (a root that is not a model);
- the guide's recipe up to the model config: a user's config_registry module, passed to torchtitan's
  ConfigManager by module path, builds the converted config (needs torchtitan's data packages too).

On the CPU the models use torchtitan's own `ScaledDotProductAttention` as their attention kernel
instead of the registry's FlexAttention (which compiles for ~30 s on the CPU and has no CPU
backward; varlen attention is CUDA-only). The converter does not touch attention.
"""

from __future__ import annotations

import pytest
import torch

llama3 = pytest.importorskip(
    "torchtitan.models.llama3", reason='needs torchtitan (pip install "fp8train[torchtitan]"; triton on CPU)'
)

from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402

import fp8train  # noqa: E402
from fp8train.integrations.torchtitan import FP8Linear, FP8TrainConverter, converted_fqns  # noqa: E402

pytestmark = pytest.mark.integration
SEQ = 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread, as the project's tests run (several threads on a shared 2-core machine are 5x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(converter=None):
    converters = None if converter is None else [converter]
    config = llama3.model_registry("debugmodel", converters=converters).model
    for layer in config.layers:  # a CPU attention kernel (see the module docstring)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _build(config, seed: int = 0):
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states()
    return model


def _inputs(seed: int = 1):
    tokens = torch.randint(0, 2048, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.arange(SEQ).expand(2, SEQ)


def test_config_level_swaps_every_eligible_linear_and_leaves_the_head_alone() -> None:
    plain = _config()
    converted = _config(FP8TrainConverter.Config())
    before = {fqn: (c.in_features, c.out_features) for fqn, c, _, _ in plain.traverse(Linear.Config)}
    after = {fqn: type(c) for fqn, c, _, _ in converted.traverse(Linear.Config)}
    assert before.keys() == after.keys() and len(before) == 31
    assert after.pop("lm_head") is Linear.Config
    assert set(after.values()) == {FP8Linear.Config} and len(after) == 30
    assert isinstance(converted, type(plain)) and type(converted) is not type(plain)
    with pytest.raises(ValueError, match="already"):
        FP8TrainConverter.Config().build().convert(converted)
    with pytest.raises(ValueError, match="no Linear to convert"):
        FP8TrainConverter.Config(filter_fqns=["layers", "lm_head"]).build().convert(_config())
    with pytest.raises(ValueError, match="fp8_format"):
        FP8TrainConverter.Config(fp8_format="E5M2").build()


def test_module_level_same_parameters_same_outputs_outside_a_region_fp8_inside() -> None:
    plain = _build(_config())
    model = _build(_config(FP8TrainConverter.Config(amax_history_len=4)))
    model.verify_module_protocol()
    assert len(converted_fqns(model)) == 30 and type(model.lm_head) is Linear
    assert all(
        isinstance(m, fp8train.FP8Module) for n, m in model.named_modules() if n in converted_fqns(model)
    )
    assert fp8train.is_prepared(model)
    ref_sd, sd = plain.state_dict(), model.state_dict()
    extra = {k for k in sd if k.endswith("_extra_state")}
    assert len(extra) == 30 and set(sd) - extra == set(ref_sd)
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    tokens, positions = _inputs()
    tokens = tokens[:, :SEQ]
    with torch.no_grad():
        expected = plain(tokens, positions=positions)
        outside = type(model).forward(model, tokens, positions=positions)
        inside = model(tokens, positions=positions)  # the prepared forward
    assert torch.equal(outside, expected)
    assert not torch.equal(inside, expected)
    rel = (inside - expected).norm() / expected.norm()
    assert rel < 0.1, rel  # FP8 (E4M3, initial scales) rounding, not a different computation


def test_the_converted_debugmodel_trains_in_fp8() -> None:
    model = _build(_config(FP8TrainConverter.Config(amax_history_len=4)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens, positions = _inputs(2)  # one fixed batch: its loss must fall
    losses = []
    for _ in range(6):
        logits = model(tokens[:, :SEQ], positions=positions)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    fp8train.synchronize()
    assert losses[-1] < losses[0] - 0.5, losses
    for name in converted_fqns(model):
        meta = model.get_submodule(name).fp8_meta
        assert meta["scaling_fwd"].amax_history[0, :2].gt(0).all(), name
        assert meta["scaling_bwd"].amax_history[0, 0].gt(0), name
    (group,) = fp8train.inspection.amax_groups()
    assert group.training_regions == 6 and len(group.fwd.members) == 30


def test_torchtitan_feed_forward_trains_in_fp8() -> None:
    ff_config = _config().layers[0].feed_forward
    converter = FP8TrainConverter.Config(amax_history_len=4).build()
    block = _build(converter.convert(ff_config))
    assert sorted(converted_fqns(block)) == ["w1", "w2", "w3"] and fp8train.is_prepared(block)
    opt = torch.optim.SGD(block.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g) * 0.1
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(block(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    fp8train.synchronize()
    assert losses[-1] < losses[0], losses
    for name in ("w1", "w2", "w3"):
        meta = getattr(block, name).fp8_meta
        assert meta["scaling_fwd"].amax_history[0, :2].gt(0).all(), name
        assert meta["scaling_bwd"].amax_history[0, 0].gt(0), name
    (group,) = fp8train.inspection.amax_groups()
    assert group.training_regions == 5  # one region per call of the block


REGISTRY = """
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from fp8train.integrations.torchtitan import FP8TrainConverter


def llama3_debugmodel_fp8train():
    config = llama3_debugmodel()
    converter = FP8TrainConverter.Config(amax_history_len=16)
    config.model_spec = model_registry("debugmodel", converters=[converter])
    return config
"""


def test_a_config_registry_passed_by_module_path_builds_the_converted_model_config(
    tmp_path, monkeypatch
) -> None:
    """The guide's recipe up to the model config: torchtitan's own ConfigManager, given `--module
    my_configs --config llama3_debugmodel_fp8train`, imports the user's registry and the converter.
    (Its trainer config imports torchtitan's data loading: datasets, torchdata; skipped without.)"""
    for module in ("torchdata", "datasets"):
        pytest.importorskip(module, reason="torchtitan's trainer config needs its data loading packages")
    from torchtitan.config import ConfigManager

    package = tmp_path / "my_configs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config_registry.py").write_text(REGISTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["--module", "my_configs", "--config", "llama3_debugmodel_fp8train", "--training.steps", "7"]
    config = ConfigManager().parse_args(args)
    assert config.training.steps == 7
    model_config = config.model_spec.model
    kinds = {fqn: type(c) for fqn, c, _, _ in model_config.traverse(Linear.Config)}
    assert kinds.pop("lm_head") is Linear.Config and set(kinds.values()) == {FP8Linear.Config}
    assert type(model_config).fp8_recipe.amax_history_len == 16

"""Published block-FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 layout): loaded as frozen FP8 layers,
LoRA and full fine-tuning on top, export in the same format (docs/guide.md, "Fine-tuning an FP8
checkpoint"). Checkpoints are made here by an independent quantizer (DeepSeek's rule, block by block
in plain loops), never by fp8train's."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re

import pytest
import torch

import fp8train
from multirank import run_ranks

MISSING = [
    m for m in ("transformers", "accelerate", "safetensors", "peft") if importlib.util.find_spec(m) is None
]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bool(MISSING), reason=f'needs {MISSING}: pip install "fp8train[hf,peft]"'),
]

RECIPE = fp8train.Float8BlockScaling()
B = 128
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [B, B]}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


# ---- the independent quantizer and reference ------------------------------------------------------
def deepseek_quantize(w: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block: s = amax / 448 (ue8m0: rounded up to a power of 2), values w / s in E4M3."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / B), math.ceil(cols / B))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = w[i * B : (i + 1) * B, j * B : (j + 1) * B].float()
            scale = block.abs().max() / 448
            if ue8m0:
                scale = torch.exp2(torch.ceil(torch.log2(scale)))
            s[i, j] = scale
            q[i * B : (i + 1) * B, j * B : (j + 1) * B] = (
                (block / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            )
    return q, s


def dequantize_ref(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * B : (i + 1) * B, j * B : (j + 1) * B] = (
                q[i * B : (i + 1) * B, j * B : (j + 1) * B].float() * s[i, j]
            )
    return out


def tile_quantize_ref(x: torch.Tensor) -> torch.Tensor:
    """x [R, C] in 1x128 tiles along C, dequantized: scale 448 / amax rounded down to a power of 2
    (Float8BlockScaling's rule, power_2_scale=True), values cast by torch to E4M3."""
    out = torch.empty(x.shape)
    for j in range(0, x.shape[1], B):
        tile = x[:, j : j + B].float()
        amax = tile.abs().amax(dim=1, keepdim=True)
        scale = torch.exp2(torch.floor(torch.log2(448 / amax)))
        out[:, j : j + B] = (tile * scale).to(torch.float8_e4m3fn).float() / scale
    return out


def fp32_gemm_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|fl(a @ b) - a @ b| <= k * u * |a| @ |b| for fp32 accumulation over k terms, any order."""
    return a.shape[1] * 2.0**-24 * (a.abs() @ b.abs()) + 1e-30


def write_checkpoint(directory: str, hidden: int, intermediate: int, ue8m0: bool = False, seed: int = 0):
    """A tiny Llama (transformers' config classes, nothing downloaded) quantized by `deepseek_quantize`:
    every linear but lm_head. Returns the dequantized reference model (transformers, float32)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            q, s = deepseek_quantize(module.weight.detach(), ue8m0)
            tensors[f"{name}.weight"] = q
            tensors[f"{name}.weight_scale_inv"] = s.to(torch.float8_e8m0fnu) if ue8m0 else s
            with torch.no_grad():
                module.weight.copy_(dequantize_ref(q, s))
    for key, value in model.state_dict().items():
        tensors.setdefault(key, value.contiguous())
    os.makedirs(directory, exist_ok=True)
    quantization = dict(
        QUANT, modules_to_not_convert=["lm_head"], **({"scale_fmt": "ue8m0"} if ue8m0 else {})
    )
    config.quantization_config = quantization
    config.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return model


def read(directory: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """Off the block: hidden 192 (1.5 blocks), intermediate 320 (2.5 blocks), kv 128."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "src")
    return directory, write_checkpoint(directory, 192, 320)


@pytest.fixture(scope="module")
def aligned(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """Whole blocks only: transformers' dequantizing load (5.x, on CPUs) refuses partial blocks
    ("not divisible by scale grid"), or, where out/ceil(out/128) divides, assumes smaller blocks."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "aligned")
    return directory, write_checkpoint(directory, 256, 384)


def tokens(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(seed))


def loss_of(model, ids) -> torch.Tensor:
    with fp8train.autocast(recipe=RECIPE):
        return model(ids, labels=ids).loss


# ---- load -----------------------------------------------------------------------------------------
def test_forward_and_input_gradient_use_the_stored_operand() -> None:
    """A layer off the block (200 x 300): y and dx equal the dequantize-then-multiply reference
    under block scaling's GEMM numerics (1x128 tiles of x and of dy, fp32 GEMM), within the fp32
    accumulation bound; no weight gradient."""
    torch.manual_seed(0)
    q, s = deepseek_quantize(torch.randn(200, 300) * 0.05)
    bias = torch.randn(200)
    layer = fp8train.StoredFP8Linear(q, s, bias)
    layer.bias.requires_grad_(True)  # a trainable bias: its gradient in its own dtype
    x = torch.randn(6, 300, requires_grad=True)
    with fp8train.autocast(recipe=RECIPE):
        y = layer(x)
    dy = torch.randn(6, 200)
    y.backward(dy)
    w = dequantize_ref(q, s)
    xq = tile_quantize_ref(x.detach())
    assert torch.all(
        (y.detach() - (xq @ w.t() + bias)).abs() <= fp32_gemm_bound(xq, w.t()) + 1e-6 * bias.abs()
    )
    gq = tile_quantize_ref(dy)
    assert torch.all((x.grad - gq @ w).abs() <= fp32_gemm_bound(gq, w))
    assert not layer.weight.requires_grad and layer.weight.grad is None
    assert layer.bias.grad.dtype == torch.float32 and torch.allclose(layer.bias.grad, dy.sum(0))
    assert layer.weight.data_ptr() == q.data_ptr()  # the stored tensor itself, not a copy


def test_loaded_model_holds_the_stored_bytes_and_computes_the_reference(checkpoint) -> None:
    from fp8train.integrations.fp8_checkpoint import load_fp8_checkpoint

    directory, reference = checkpoint
    model = load_fp8_checkpoint(directory)
    stored = read(directory)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, fp8train.StoredFP8Linear)}
    assert len(layers) == 14 and "lm_head" not in layers
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
    params = base_bytes = scale_bytes = 0
    for name, layer in layers.items():
        assert same_bytes(layer.weight, stored[f"{name}.weight"])
        assert torch.equal(layer.weight_scale_inv, stored[f"{name}.weight_scale_inv"])
        tensors = list(layer.parameters()) + list(layer.buffers())
        assert {t.dtype for t in tensors} == {torch.float8_e4m3fn, torch.float32} and len(tensors) == 2
        params += layer.weight.numel()
        base_bytes += layer.weight.untyped_storage().nbytes()
        scale_bytes += layer.weight_scale_inv.untyped_storage().nbytes()
    assert base_bytes / params <= 1.01 and scale_bytes / params <= 4 * 4 / (B * B)  # partial blocks
    ids = tokens(0)
    with torch.no_grad():
        ours = model(ids).logits
        theirs = reference(ids).logits  # dequantized weights, outside an FP8 region: the same weights
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    with torch.no_grad(), fp8train.autocast(recipe=RECIPE):
        fp8 = model(ids).logits
    assert 0 < (fp8 - theirs).abs().max() < 0.1 * theirs.abs().max()  # FP8 activations: close, not equal


def test_meta_device_build_then_load(checkpoint) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    from fp8train.integrations.fp8_checkpoint import load_fp8_checkpoint

    directory, _ = checkpoint
    config = AutoConfig.from_pretrained(directory)
    del config.quantization_config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = load_fp8_checkpoint(directory, model=model)
    assert not [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    built = load_fp8_checkpoint(directory)
    assert torch.equal(model.model.rotary_emb.inv_freq, built.model.rotary_emb.inv_freq)
    ids = tokens(1)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, built(ids).logits)


def test_convert_a_built_transformers_fp8_model_shares_its_tensors(checkpoint) -> None:
    """transformers' own FP8Linear modules (what it builds on a GPU) become StoredFP8Linear layers
    holding the very same tensors."""
    from transformers import AutoConfig, FineGrainedFP8Config, LlamaForCausalLM
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    from fp8train.integrations.fp8_checkpoint import convert_fp8_model

    directory, _ = checkpoint
    config = AutoConfig.from_pretrained(directory)
    del config.quantization_config
    model = LlamaForCausalLM(config)
    replace_with_fp8_linear(
        model, ["lm_head"], FineGrainedFP8Config(weight_block_size=(B, B)), pre_quantized=True
    )
    stored = read(directory)
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale_inv"):
            for key in ("weight", "weight_scale_inv"):
                setattr(module, key, torch.nn.Parameter(stored[f"{name}.{key}"], requires_grad=False))
    convert_fp8_model(model)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, fp8train.StoredFP8Linear)
    assert q_proj.weight.data_ptr() == stored["model.layers.0.self_attn.q_proj.weight"].data_ptr()


class TinyMoE(torch.nn.Module):
    """Top-1 routing over experts stored as separate linears (experts.N.up / experts.N.down)."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.router = torch.nn.Linear(128, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {"up": torch.nn.Linear(128, 256, bias=False), "down": torch.nn.Linear(256, 128, bias=False)}
            )
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = choice == i
            out[rows] = expert["down"](torch.relu(expert["up"](x[rows])))
        return out


def test_moe_experts_stored_as_separate_linears() -> None:
    """Each expert's FP8 linears (an nn.Linear holding float8 weight + weight_scale_inv, as
    transformers' FP8Linear does) become StoredFP8Linear layers; routing is untouched."""
    from fp8train.integrations.fp8_checkpoint import convert_fp8_model

    torch.manual_seed(0)
    model = TinyMoE()
    reference = TinyMoE()
    reference.load_state_dict(model.state_dict())
    for source, target in zip(model.experts, reference.experts):
        for key in ("up", "down"):
            q, s = deepseek_quantize(source[key].weight.detach())
            source[key].weight = torch.nn.Parameter(q, requires_grad=False)
            source[key].weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
            target[key].weight.data = dequantize_ref(q, s)
    convert_fp8_model(model)
    assert all(isinstance(e[k], fp8train.StoredFP8Linear) for e in model.experts for k in ("up", "down"))
    assert type(model.router) is torch.nn.Linear
    x = torch.randn(32, 128)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad(), fp8train.autocast(recipe=RECIPE):
        fp8 = model(x)
    assert 0 < (fp8 - reference(x)).abs().max() < 0.1 * reference(x).abs().max()


def _corrupt(src: str, dst: str, edit) -> None:
    from safetensors.torch import save_file

    tensors = read(src)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    edit(tensors, config)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(dst, "model.safetensors"))


KEY = "model.layers.1.mlp.up_proj.weight"


def _assert_refused_and_nothing_loaded(directory: str, bad: str, message: str, model_cls) -> None:
    """The checkpoint `bad` (a corrupted copy of `directory`) is refused with `message`, alone and into
    a model built from its config: that model keeps every value and gains no stored FP8 layer."""
    from transformers import AutoConfig

    from fp8train.integrations.fp8_checkpoint import BlockFormatError, load_fp8_checkpoint

    with pytest.raises(BlockFormatError, match=re.escape(message)):
        load_fp8_checkpoint(bad)
    config = AutoConfig.from_pretrained(directory)
    del config.quantization_config
    model = model_cls(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BlockFormatError, match=re.escape(message)):
        load_fp8_checkpoint(bad, model=model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(
        isinstance(m, (fp8train.StoredFP8Linear, fp8train.StoredFP8Experts)) for m in model.modules()
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t, c: t.update({KEY + "_scale_inv": torch.ones(2, 2)}), KEY + "_scale_inv has shape (2, 2)"),
        (lambda t, c: t.pop(KEY + "_scale_inv"), f"{KEY} is FP8 but the checkpoint has no {KEY}_scale_inv"),
        (
            lambda t, c: c["quantization_config"].update(weight_block_size=[1, 128]),
            "weight_block_size=[1, 128]",
        ),
        (
            lambda t, c: t.update({KEY: t[KEY][None]}),
            "is a 3-D FP8 tensor (1, 320, 192): fused expert tensors are read per expert",
        ),
        (lambda t, c: t.pop("model.norm.weight"), "has no tensor for model.norm.weight"),
        (
            lambda t, c: t.update({"model.norm.weight": t["model.norm.weight"][:-1].clone()}),
            "model.norm.weight has shape (191,), the model's is (192,)",
        ),
        (
            lambda t, c: t[KEY + "_scale_inv"].__setitem__((1, 0), float("nan")),
            f"{KEY}_scale_inv has a scale of nan in block (1, 0)",
        ),
        (
            lambda t, c: t[KEY + "_scale_inv"].__setitem__((0, 1), float("inf")),
            f"{KEY}_scale_inv has a scale of inf in block (0, 1)",
        ),
        (
            lambda t, c: t[KEY + "_scale_inv"].__setitem__((1, 1), 0.0),
            f"{KEY}_scale_inv has a scale of 0.0 in block (1, 1)",
        ),
        (
            lambda t, c: t[KEY + "_scale_inv"].__setitem__((0, 0), -0.5),
            f"{KEY}_scale_inv has a scale of -0.5 in block (0, 0)",
        ),
        (
            lambda t, c: t.update({KEY: t[KEY].float().to(torch.float8_e5m2)}),
            f"{KEY} is torch.float8_e5m2, a block-FP8 weight is torch.float8_e4m3fn",
        ),
    ],
    ids=[
        "scale-shape",
        "missing-scale",
        "block-size",
        "3d-experts",
        "missing-tensor",
        "tensor-shape",
        "nan-scale",
        "inf-scale",
        "zero-scale",
        "negative-scale",
        "e5m2-weight",
    ],  # fmt: skip
)
def test_bad_checkpoint_is_a_clear_error_and_nothing_is_loaded(checkpoint, tmp_path, edit, message) -> None:
    from transformers import LlamaForCausalLM

    directory, _ = checkpoint
    bad = str(tmp_path / "bad")
    _corrupt(directory, bad, edit)
    _assert_refused_and_nothing_loaded(directory, bad, message, LlamaForCausalLM)


def test_stored_layer_takes_e8m0_scales_and_refuses_bad_ones_at_construction() -> None:
    """The scale dtypes the loader takes (float32, float8_e8m0fnu, uint8 exponent bytes) are taken
    by the layer itself, converted at construction (the same forward as float32 scales); a scale of
    another dtype, or a non-finite or non-positive one, is refused there, not at the first forward."""
    torch.manual_seed(0)
    q, s = deepseek_quantize(torch.randn(200, 300) * 0.05, ue8m0=True)
    x = torch.randn(6, 300)
    with torch.no_grad(), fp8train.autocast(recipe=RECIPE):
        expected = fp8train.StoredFP8Linear(q, s)(x)
    for stored in (s.to(torch.float8_e8m0fnu), s.to(torch.float8_e8m0fnu).view(torch.uint8)):
        layer = fp8train.StoredFP8Linear(q, stored)
        assert layer.weight_scale_inv.dtype == torch.float32 and torch.equal(layer.weight_scale_inv, s)
        with torch.no_grad(), fp8train.autocast(recipe=RECIPE):
            assert torch.equal(layer(x), expected)
        with torch.no_grad():
            assert torch.equal(layer(x), x @ dequantize_ref(q, s).t())
    from fp8train.quantization.stored_block_weights import BlockFormatError

    with pytest.raises(BlockFormatError, match="weight_scale_inv is torch.bfloat16"):
        fp8train.StoredFP8Linear(q, s.bfloat16())
    bad = s.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(BlockFormatError, match=r"up.weight_scale_inv has a scale of nan in block \(1, 2\)"):
        fp8train.StoredFP8Linear(q, bad, name="up.weight")


def _hand_built_checkpoint(directory: str, ue8m0: bool) -> tuple[torch.nn.Module, dict]:
    """TinyMoE's expert linears quantized into `directory` with a config.json that holds only the
    quantization_config (a hand-built module has no transformers config). Returns the float32
    reference (dequantized weights) and the stored tensors."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = TinyMoE()
    tensors = {}
    for name, module in reference.named_modules():
        if name.startswith("experts.") and isinstance(module, torch.nn.Linear):
            q, s = deepseek_quantize(module.weight.detach(), ue8m0)
            tensors[f"{name}.weight"] = q
            tensors[f"{name}.weight_scale_inv"] = s.to(torch.float8_e8m0fnu) if ue8m0 else s
            module.weight.data = dequantize_ref(q, s)
    tensors.update({k: v for k, v in reference.state_dict().items() if k not in tensors})
    os.makedirs(directory, exist_ok=True)
    quantization = dict(QUANT, **({"scale_fmt": "ue8m0"} if ue8m0 else {}))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"quantization_config": quantization}, f)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return reference, tensors


def test_hand_built_model_without_a_config_loads_and_exports(tmp_path) -> None:
    """model= may be a module without a transformers `.config`: it is filled (nothing is written into
    a config it does not have), remembers the checkpoint's quantization_config, and exports to a
    directory the same call loads again, bit for bit."""
    from fp8train.integrations.fp8_checkpoint import (
        export_fp8_checkpoint,
        load_fp8_checkpoint,
        quantization_config_of,
    )

    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    reference, stored = _hand_built_checkpoint(src, ue8m0=True)
    model = load_fp8_checkpoint(src, model=TinyMoE())
    assert not hasattr(model, "config")
    assert all(isinstance(e[k], fp8train.StoredFP8Linear) for e in model.experts for k in ("up", "down"))
    assert quantization_config_of(model)["scale_fmt"] == "ue8m0"
    x = torch.randn(32, 128)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), atol=1e-5, rtol=1e-5)
    export_fp8_checkpoint(model, out)
    exported = read(out)
    assert stored.keys() == exported.keys() and all(same_bytes(stored[k], exported[k]) for k in stored)
    again = load_fp8_checkpoint(out, model=TinyMoE())
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


# ---- adapters, export -----------------------------------------------------------------------------
def test_peft_takes_the_fp8_layers_dimensions_without_an_unsupported_layer_warning(aligned) -> None:
    """PEFT warns "Unsupported layer type ... proceed at your own risk" for base layers it does not
    know; FP8LoraLinear gives StoredFP8Linear's dimensions through PEFT's hook, so nothing is warned."""
    import warnings

    import peft

    from fp8train.integrations.fp8_checkpoint import load_fp8_checkpoint
    from fp8train.integrations.peft_fp8 import lora_config

    directory, _ = aligned
    base = load_fp8_checkpoint(directory)
    q_proj = base.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, fp8train.StoredFP8Linear)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.get_peft_model(base, lora_config(**LORA))
    assert not [str(w.message) for w in caught if "Unsupported layer type" in str(w.message)]
    lora = model.base_model.model.model.layers[0].self_attn.q_proj
    assert (lora.in_features, lora.out_features) == (q_proj.in_features, q_proj.out_features)


def test_lora_trains_base_bytes_unchanged_export_read_by_transformers(aligned, tmp_path) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    from fp8train.integrations.fp8_checkpoint import (
        export_fp8_checkpoint,
        iter_fp8_weights,
        load_fp8_checkpoint,
    )
    from fp8train.integrations.peft_fp8 import FP8LoraLinear, load_adapter, lora_config
    from fp8train.quantization.stored_block_weights import quantize_block_weight

    directory, _ = aligned
    model = peft.get_peft_model(load_fp8_checkpoint(directory), lora_config(**LORA))
    lora = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(lora, FP8LoraLinear) and lora.lora_A["default"].weight.dtype == torch.float32
    base = {n: p.clone() for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids, losses = tokens(2), []
    for _ in range(6):
        loss = loss_of(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3
    assert all(same_bytes(p, base[n]) for n, p in model.named_parameters() if n in base)

    out = str(tmp_path / "export")
    export_fp8_checkpoint(model, out)
    exported = read(out)
    name = "model.layers.0.self_attn.q_proj"
    merged = lora.get_base_layer().dequantized() + lora.get_delta_weight("default")
    expected = quantize_block_weight(merged, RECIPE)
    assert same_bytes(exported[f"{name}.weight"], expected[0]) and torch.equal(
        exported[f"{name}.weight_scale_inv"], expected[1]
    )
    untouched = "model.layers.0.self_attn.k_proj"
    stored = read(directory)
    for suffix in (".weight", ".weight_scale_inv"):
        assert same_bytes(exported[untouched + suffix], stored[untouched + suffix])
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [B, B]

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # CPU: transformers dequantizes
    ours = dict((n, (t, s)) for n, t, s in iter_fp8_weights(model))
    for key, param in hf.state_dict().items():
        tensor, scale = ours[key]
        assert torch.equal(param, dequantize_ref(tensor, scale) if scale is not None else tensor), key

    with torch.no_grad():  # PEFT's save/load of the adapters, and merge_and_unload, agree
        trained = model(ids).logits
        model.save_pretrained(str(tmp_path / "adapter"))
        again = load_adapter(load_fp8_checkpoint(directory), str(tmp_path / "adapter"))
        assert torch.equal(again(ids).logits, trained)
        unloaded = again.merge_and_unload()
        assert isinstance(unloaded.model.layers[0].self_attn.q_proj, fp8train.StoredFP8Linear)
        assert same_bytes(unloaded.model.layers[0].self_attn.q_proj.weight, expected[0])


@pytest.mark.parametrize("ue8m0", [False, True], ids=["float-scales", "ue8m0-scales"])
def test_untouched_model_round_trips_bit_for_bit(tmp_path, ue8m0: bool) -> None:
    import peft

    from fp8train.integrations.fp8_checkpoint import export_fp8_checkpoint, load_fp8_checkpoint
    from fp8train.integrations.peft_fp8 import lora_config

    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    write_checkpoint(src, 128, 256, ue8m0=ue8m0)
    export_fp8_checkpoint(load_fp8_checkpoint(src), out)
    a, b = read(src), read(out)
    assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
    # fresh adapters (B = 0) add nothing: their layers are untouched too
    export_fp8_checkpoint(peft.get_peft_model(load_fp8_checkpoint(src), lora_config(**LORA)), out)
    b = read(out)
    assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"].get("scale_fmt", "float") == (
            "ue8m0" if ue8m0 else "float"
        )


# ---- full fine-tuning -----------------------------------------------------------------------------
def _first_weight_operand(model, ids, recipe):
    """The weight operand of model.layers[0].mlp.up_proj in a training forward under `recipe`."""
    from fp8train.quantization.block_scaling import BlockQuantization

    seen = []
    original = BlockQuantization.quantize_weight

    def spy(self, weight, call):
        operands = original(self, weight, call)
        seen.append(operands.forward)
        return operands

    BlockQuantization.quantize_weight = spy
    try:
        with fp8train.autocast(recipe=recipe):
            loss = model(ids, labels=ids).loss
    finally:
        BlockQuantization.quantize_weight = original
    index = [n for n, m in model.named_modules() if isinstance(m, fp8train.Linear)].index(
        "model.layers.0.mlp.up_proj"
    )
    return loss, seen[index]


@pytest.mark.parametrize("ue8m0", [False, True], ids=["float-scales", "ue8m0-scales"])
def test_full_finetuning_first_operand_and_export(tmp_path, ue8m0: bool) -> None:
    """Master weights = the dequantized stored ones. Power-of-2 stored scales (ue8m0) under the
    default recipe: the first operand multiplies exactly the stored weight. Scales amax/448 under
    power_2_scale=False: the same FP8 values, scale_inv within 1 ulp (1/(448/amax) vs amax/448).
    After training, the export is the operand the training forward uses."""
    from fp8train.integrations.fp8_checkpoint import (
        export_fp8_checkpoint,
        full_finetuning,
        load_fp8_checkpoint,
    )

    src = str(tmp_path / "src")
    write_checkpoint(src, 128, 256, ue8m0=ue8m0)
    recipe = RECIPE if ue8m0 else fp8train.Float8BlockScaling(power_2_scale=False)
    model = full_finetuning(load_fp8_checkpoint(src))
    stored = read(src)
    key = "model.layers.0.mlp.up_proj.weight"
    q, s = stored[key], stored[key + "_scale_inv"].float()
    ids = tokens(3)
    loss, operand = _first_weight_operand(model, ids, recipe)
    if ue8m0:
        assert torch.equal(operand.dequantize(), dequantize_ref(q, s))
    else:
        assert same_bytes(operand.values, q)
        ulps = (operand.scale_inv.view(torch.int32) - s.view(torch.int32)).abs()
        assert ulps.max() <= 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    out = str(tmp_path / "out")
    export_fp8_checkpoint(model, out, recipe)
    _, trained = _first_weight_operand(model, ids, recipe)
    exported = read(out)
    assert same_bytes(exported[key], trained.values) and torch.equal(
        exported[key + "_scale_inv"].float(), trained.scale_inv
    )
    assert not same_bytes(exported[key], q)  # it trained


# ---- DDP ------------------------------------------------------------------------------------------
def _ddp_lora(rank: int, world_size: int, directory: str) -> dict:
    import peft
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp8train.integrations.fp8_checkpoint import exclude_stored_from_ddp, load_fp8_checkpoint
    from fp8train.integrations.peft_fp8 import lora_config

    torch.manual_seed(0)  # the same adapter initialisation on every rank (DDP broadcasts it anyway)
    model = peft.get_peft_model(load_fp8_checkpoint(directory), lora_config(**LORA))
    base = {n: p.clone() for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    ddp = DDP(exclude_stored_from_ddp(model))  # gloo cannot broadcast FP8 tensors
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(4):
        loss = loss_of(ddp, tokens(100 * step + rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    unchanged = all(same_bytes(p, base[n]) for n, p in model.named_parameters() if n in base)
    return {"adapters": adapters, "losses": losses, "base_unchanged": unchanged}


@pytest.mark.multirank
def test_ddp_lora_on_two_ranks(checkpoint) -> None:
    directory, _ = checkpoint
    r0, r1 = run_ranks(_ddp_lora, 2, directory, timeout_s=240)
    assert r0["base_unchanged"] and r1["base_unchanged"]
    assert r0["adapters"].keys() == r1["adapters"].keys() and r0["adapters"]
    assert all(torch.equal(r0["adapters"][k], r1["adapters"][k]) for k in r0["adapters"])
    assert r0["losses"] != r1["losses"]  # different data per rank, the same adapters


def test_a_model_of_stored_fp8_layers_pickles(tmp_path) -> None:
    """pickle cannot rebuild a float8 tensor (torch's own limitation: pickle.loads of any float8
    tensor fails); a StoredFP8Linear carries its stored weight as bytes through pickle, deepcopy and
    torch.save, and the copy holds the same bytes as the same frozen float8 parameter."""
    import copy
    import io
    import pickle

    from fp8train.integrations.fp8_checkpoint import load_fp8_checkpoint

    src = str(tmp_path / "src")
    _hand_built_checkpoint(src, ue8m0=False)
    model = load_fp8_checkpoint(src, model=TinyMoE())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [
        pickle.loads(pickle.dumps(model)),
        copy.deepcopy(model),
        torch.load(buffer, weights_only=False),
    ]
    x = torch.randn(32, 128)
    with torch.no_grad(), fp8train.autocast(recipe=RECIPE):
        expected = model(x)
    for other in copies:
        for name, layer in model.named_modules():
            if isinstance(layer, fp8train.StoredFP8Linear):
                copied = other.get_submodule(name)
                assert isinstance(copied.weight, torch.nn.Parameter) and not copied.weight.requires_grad
                assert same_bytes(copied.weight, layer.weight)
                assert torch.equal(copied.weight_scale_inv, layer.weight_scale_inv)
        with torch.no_grad(), fp8train.autocast(recipe=RECIPE):
            assert torch.equal(other(x), expected)


# ---- fused experts (transformers' Qwen3-MoE and Mixtral) from per-expert FP8 tensors ----------------
EXPERT_NAMES = {"qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
                "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2"))}  # fmt: skip


def write_moe_checkpoint(directory: str, family: str, hidden: int = 256, ue8m0: bool = False):
    """A tiny Qwen3-MoE or Mixtral (4 experts of intermediate 128, top-2, 2 layers; built from its config)
    in DeepSeek-V3's per-expert layout, `<layer>.<experts>.<e>.<gate|up|down>.weight` (Mixtral's
    original names: block_sparse_moe, w1/w3/w2), every linear but lm_head and the router quantized by
    `deepseek_quantize`. Returns transformers' model with the dequantized weights (eager experts)."""
    import transformers
    from safetensors.torch import save_file

    common = dict(
        vocab_size=256, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=256, moe_intermediate_size=128, num_experts=4, decoder_sparse_step=1
        )
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=4)
        model_class = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    model = model_class(config)
    model.config._experts_implementation = "eager"
    tensors = {}

    def stored(key: str, w: torch.Tensor) -> torch.Tensor:
        q, s = deepseek_quantize(w.detach(), ue8m0)
        tensors[key], tensors[key + "_scale_inv"] = q, s.to(torch.float8_e8m0fnu) if ue8m0 else s
        return dequantize_ref(q, s)

    path, (gate, up, down) = EXPERT_NAMES[family]
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(stored(f"{name}.weight", module.weight))
            elif type(module).__name__.endswith("Experts"):
                prefix, inter = f"{name.rsplit('.mlp.experts', 1)[0]}.{path}", module.down_proj.shape[2]
                for e, (gate_up, down_proj) in enumerate(zip(module.gate_up_proj, module.down_proj)):
                    gate_up[:inter] = stored(f"{prefix}.{e}.{gate}.weight", gate_up[:inter])
                    gate_up[inter:] = stored(f"{prefix}.{e}.{up}.weight", gate_up[inter:])
                    down_proj.copy_(stored(f"{prefix}.{e}.{down}.weight", down_proj))
    for key, value in model.state_dict().items():
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors.setdefault(key, value.contiguous())
    os.makedirs(directory, exist_ok=True)
    quantization = dict(QUANT, modules_to_not_convert=["lm_head", "gate"])
    config.quantization_config = dict(quantization, **({"scale_fmt": "ue8m0"} if ue8m0 else {}))
    config.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return model


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_checkpoint(request, tmp_path_factory) -> tuple[str, str, torch.nn.Module]:
    directory = str(tmp_path_factory.mktemp("moe") / request.param)
    return request.param, directory, write_moe_checkpoint(directory, request.param)


def _random_stored_experts(hidden: int = 192, inter: int = 128, experts: int = 3, ue8m0: bool = True):
    """StoredFP8Experts of random per-expert tensors (hidden off the block: partial blocks), and the
    dequantized (gate_up, down) they hold, by the independent reference."""
    torch.manual_seed(0)
    per = [
        [deepseek_quantize(torch.randn(*shape) * 0.05, ue8m0) for _ in range(experts)]
        for shape in ((inter, hidden), (inter, hidden), (hidden, inter))
    ]
    layer = fp8train.StoredFP8Experts.from_expert_tensors(*per, torch.nn.functional.silu, name="experts")
    gate_up = torch.stack(
        [torch.cat([dequantize_ref(*g), dequantize_ref(*u)]) for g, u in zip(per[0], per[1])]
    )
    down = torch.stack([dequantize_ref(*d) for d in per[2]])
    return layer, gate_up, down, per


def test_stored_experts_gemms_use_the_stored_operands() -> None:
    """Each expert's GEMM (gate_up and down, hidden off the block) against the independent reference:
    y = tile-quantized x @ dequantized W.T within the fp32 accumulation bound, dx = tile-quantized dy @ W
    likewise, an expert with no token included; the weights are the stored bytes (no high-precision
    copy) and get no gradient."""
    layer, gate_up, down, per = _random_stored_experts()
    assert layer.gate_up_proj.dtype == torch.float8_e4m3fn and layer.gate_up_proj.shape == (3, 256, 192)
    assert {p.dtype for p in layer.parameters()} == {torch.float8_e4m3fn, torch.float32}
    assert same_bytes(layer.gate_up_proj[1, 128:], per[1][1][0]) and same_bytes(
        layer.down_proj[2], per[2][2][0]
    )
    counts = [5, 0, 3]
    for first, weights, features in ((0, gate_up, 192), (3, down, 128)):
        x = torch.randn(sum(counts), features, requires_grad=True)
        with fp8train.autocast(recipe=RECIPE):
            y = layer._experts_gemm(x, counts, first)
        dy = torch.randn_like(y)
        y.backward(dy)
        rows = torch.tensor(counts).cumsum(0).tolist()
        for e, (start, end) in enumerate(zip([0] + rows[:-1], rows)):
            if start == end:
                continue
            xq, gq, w = tile_quantize_ref(x.detach()[start:end]), tile_quantize_ref(dy[start:end]), weights[e]
            assert torch.all((y.detach()[start:end] - xq @ w.t()).abs() <= fp32_gemm_bound(xq, w.t()))
            assert torch.all((x.grad[start:end] - gq @ w).abs() <= fp32_gemm_bound(gq, w))
    assert all(p.grad is None and not p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_stored_experts_compute_transformers_experts_on_the_dequantized_weights(family: str) -> None:
    """Outside an FP8 region: transformers' own eager experts over the dequantized weights, bit for bit.
    Inside one (block scaling): FusedExperts (fp8train's FP8 experts) over the dequantized weights,
    whose power-of-2 block scales requantize to the same operand: the same output and input gradient,
    bit for bit. Copies (deepcopy, pickle) compute the same."""
    import copy
    import pickle

    import transformers

    from fp8train.modules import FusedExperts

    layer, gate_up, down, _ = _random_stored_experts(experts=4)
    common = dict(hidden_size=192, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=128, num_experts=4)
        experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=4)
        experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    reference = copy.deepcopy(experts)
    fused = FusedExperts(experts)
    tokens = 12
    top_k_index = torch.randint(0, 4, (tokens, 2), generator=torch.Generator().manual_seed(1))
    top_k_index[:, 0] = torch.where(top_k_index[:, 0] == 3, 0, top_k_index[:, 0])  # expert 3: top-2 only
    top_k_weights = torch.rand(tokens, 2)
    x = torch.randn(tokens, 192)
    with torch.no_grad():
        assert torch.equal(layer(x, top_k_index, top_k_weights), reference(x, top_k_index, top_k_weights))
    results = []
    for module in (layer, fused, copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        xx = x.clone().requires_grad_(True)
        with fp8train.autocast(recipe=RECIPE):
            y = module(xx, top_k_index, top_k_weights)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), xx.grad))
    for y, dx in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(dx, results[0][1])
    assert not torch.equal(results[0][0], reference(x, top_k_index, top_k_weights).detach())  # FP8: not hp


def test_fused_experts_checkpoint_loads_as_stored_experts_and_exports_bit_for_bit(moe_checkpoint, tmp_path):
    """Per-expert FP8 tensors load into StoredFP8Experts holding the stored bytes (fused, no
    high-precision copy); the model computes transformers' reference outside FP8 and trains (LoRA on
    attention, FP8) with the experts' bytes unchanged; the export has the same keys and bytes, and
    transformers' own load of it holds the same dequantized experts."""
    import peft
    import transformers

    from fp8train.integrations.fp8_checkpoint import (
        export_fp8_checkpoint,
        full_finetuning,
        load_fp8_checkpoint,
    )
    from fp8train.integrations.peft_fp8 import lora_config

    family, directory, reference = moe_checkpoint
    model = load_fp8_checkpoint(directory)
    stored = read(directory)
    path, (gate, up, down) = EXPERT_NAMES[family]
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, fp8train.StoredFP8Experts)
    prefix = f"model.layers.1.{path}.2"
    assert same_bytes(experts.gate_up_proj[2, :128], stored[f"{prefix}.{gate}.weight"])
    assert same_bytes(experts.gate_up_proj[2, 128:], stored[f"{prefix}.{up}.weight"])
    assert torch.equal(experts.down_proj_scale_inv[2], stored[f"{prefix}.{down}.weight_scale_inv"])
    assert {t.dtype for t in experts.parameters()} == {torch.float8_e4m3fn, torch.float32}
    ids = tokens(0)
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    report = fp8train.coverage(model, RECIPE)
    assert sum(1 for row in report.layers if row.layer == "StoredFP8Experts" and row.frozen and row.fp8) == 16

    out = str(tmp_path / "out")
    export_fp8_checkpoint(model, out)
    exported = read(out)
    assert stored.keys() == exported.keys() and all(same_bytes(stored[k], exported[k]) for k in stored)

    tuned = peft.get_peft_model(model, lora_config(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = loss_of(tuned, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    export_fp8_checkpoint(tuned, out)
    after = read(out)
    expert_keys = [k for k in stored if f".{path}." in k]
    assert len(expert_keys) == 2 * 4 * 3 * 2 and all(same_bytes(after[k], stored[k]) for k in expert_keys)

    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = load_fp8_checkpoint(directory)
    for layer in range(2):
        hf = theirs.model.layers[layer].mlp.experts
        gate_up, down_proj = ours.model.layers[layer].mlp.experts.dequantized()
        assert torch.equal(hf.gate_up_proj, gate_up) and torch.equal(hf.down_proj, down_proj)
    with pytest.warns(UserWarning, match=r"2 fused experts modules .* stay frozen FP8"):
        full_finetuning(ours)  # the rest trains; the experts stay stored
    assert isinstance(ours.model.layers[0].mlp.experts, fp8train.StoredFP8Experts)
    assert isinstance(ours.model.layers[0].self_attn.q_proj, fp8train.BlockFP8Linear)


@pytest.fixture(scope="module")
def qwen3_moe_checkpoint(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("moe") / "qwen3_moe")
    write_moe_checkpoint(directory, "qwen3_moe")
    return directory


EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: [t.pop(EXPERT), t.pop(EXPERT + "_scale_inv")], f"the checkpoint has no {EXPERT}"),
        (
            lambda t: t.pop(EXPERT + "_scale_inv"),
            f"{EXPERT} is FP8 but the checkpoint has no {EXPERT}_scale_inv",
        ),
        (
            lambda t: t.update({EXPERT + "_scale_inv": torch.ones(2, 2)}),
            f"{EXPERT}_scale_inv has shape (2, 2)",
        ),
        (
            lambda t: t.update({EXPERT: t[EXPERT][:, :128].clone(), EXPERT + "_scale_inv": torch.ones(1, 1)}),
            f"{EXPERT} has shape (128, 128), but expert 0's gate (128, 256) makes it (128, 256)",
        ),
        (
            lambda t: t[EXPERT + "_scale_inv"].__setitem__((0, 1), float("nan")),
            f"{EXPERT}_scale_inv has a scale of nan in block (0, 1)",
        ),
        (
            lambda t: t.update({EXPERT.replace(".2.", ".4."): t[EXPERT].clone()}),
            f"{EXPERT.replace('.2.', '.4.')} is not a tensor of model.layers.1.mlp.experts",
        ),
        (
            lambda t: t.update({EXPERT.replace("weight", "bias"): torch.zeros(128)}),
            f"{EXPERT.replace('weight', 'bias')} is not a tensor of model.layers.1.mlp.experts",
        ),
        (
            lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj": torch.zeros(4, 256, 256)}),
            "has tensors the model does not: model.layers.1.mlp.experts.gate_up_proj",
        ),
    ],
    ids=[
        "missing-expert",
        "missing-scale",
        "scale-shape",
        "weight-shape",
        "nan-scale",
        "no-such-expert",
        "bias",
        "fused-and-per-expert",
    ],  # fmt: skip
)
def test_bad_fused_experts_checkpoint_is_a_clear_error_and_nothing_is_loaded(
    qwen3_moe_checkpoint, tmp_path, edit, message
) -> None:
    from transformers import Qwen3MoeForCausalLM

    bad = str(tmp_path / "bad")
    _corrupt(qwen3_moe_checkpoint, bad, lambda t, c: edit(t))
    _assert_refused_and_nothing_loaded(qwen3_moe_checkpoint, bad, message, Qwen3MoeForCausalLM)


def test_stored_experts_refuse_an_intermediate_size_off_the_block() -> None:
    """gate and up share one tensor of 128x128 blocks: an intermediate size off 128 would put gate and up
    rows in one block, so it is refused, naming the first gate tensor."""
    from fp8train.quantization.stored_block_weights import BlockFormatError

    per = [[deepseek_quantize(torch.randn(*shape))] for shape in ((64, 128), (64, 128), (128, 64))]
    with pytest.raises(
        BlockFormatError, match=r"experts\.0\.gate_proj\.weight has 64 rows .* not a multiple of 128"
    ):
        fp8train.StoredFP8Experts.from_expert_tensors(*per, torch.nn.functional.silu)


def test_convert_a_built_transformers_fp8_moe_shares_its_expert_tensors(
    qwen3_moe_checkpoint, tmp_path
) -> None:
    """transformers' own FP8 experts (FP8Experts: what it builds on a GPU, the fused layout) become
    StoredFP8Experts holding the very same tensors; the export writes them per expert, the bytes and
    keys of the per-expert checkpoint they were stacked from."""
    from transformers import AutoConfig, FineGrainedFP8Config, Qwen3MoeForCausalLM
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    from fp8train.integrations.fp8_checkpoint import (
        convert_fp8_model,
        export_fp8_checkpoint,
        load_fp8_checkpoint,
    )

    config = AutoConfig.from_pretrained(qwen3_moe_checkpoint)
    quantization = config.quantization_config
    del config.quantization_config
    model = Qwen3MoeForCausalLM(config)
    replace_with_fp8_linear(
        model, ["lm_head", "gate"], FineGrainedFP8Config(weight_block_size=(B, B)), pre_quantized=True
    )
    stored = read(qwen3_moe_checkpoint)
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "weight_scale_inv"):
                for key in ("weight", "weight_scale_inv"):
                    setattr(module, key, torch.nn.Parameter(stored[f"{name}.{key}"], requires_grad=False))
            elif type(module).__name__ == "FP8Experts":  # its parameters are on "meta": assigned
                for suffix in ("", "_scale_inv"):
                    per = [
                        [stored[f"{name}.{e}.{p}.weight{suffix}"] for e in range(4)]
                        for p in ("gate_proj", "up_proj", "down_proj")
                    ]
                    gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(per[0], per[1])])
                    setattr(module, f"gate_up_proj{suffix}", torch.nn.Parameter(gate_up, requires_grad=False))
                    setattr(
                        module,
                        f"down_proj{suffix}",
                        torch.nn.Parameter(torch.stack(per[2]), requires_grad=False),
                    )
            else:
                for key, tensor in module.named_parameters(recurse=False):
                    full = f"{name}.{key}" if name else key
                    if full in stored:
                        tensor.copy_(stored[full])
    fp8_experts = model.model.layers[0].mlp.experts
    pointer = fp8_experts.gate_up_proj.data_ptr()
    convert_fp8_model(model)
    converted = model.model.layers[0].mlp.experts
    assert isinstance(converted, fp8train.StoredFP8Experts) and converted.gate_up_proj.data_ptr() == pointer
    ids = tokens(4)
    with torch.no_grad(), fp8train.autocast(recipe=RECIPE):  # the model the checkpoint loads as
        assert torch.equal(model(ids).logits, load_fp8_checkpoint(qwen3_moe_checkpoint)(ids).logits)
    model.config.quantization_config = quantization
    out = str(tmp_path / "out")
    export_fp8_checkpoint(model, out)
    exported = read(out)
    assert stored.keys() == exported.keys() and all(same_bytes(stored[k], exported[k]) for k in stored)


@pytest.mark.parametrize(
    "recipe",
    [fp8train.DelayedScaling(), fp8train.Float8CurrentScaling(), fp8train.MXFP8BlockScaling()],
    ids=["delayed", "current", "mxfp8"],
)
def test_stored_experts_train_under_other_recipes_whatever_the_routing(recipe) -> None:
    """The stored operands under the region's recipe for the activations (MXFP8: each expert's rows
    padded to 32, the routing off it): output and input gradient within FP8 rounding of the
    dequantized computation, none exact, no weight gradient."""
    layer, gate_up, down, _ = _random_stored_experts(hidden=256, experts=4)
    top_k_index = torch.randint(0, 4, (10, 2), generator=torch.Generator().manual_seed(2))
    top_k_weights = torch.rand(10, 2)
    x = torch.randn(10, 256)
    results = []
    for enabled in (False, True):
        xx = x.clone().requires_grad_(True)
        with fp8train.autocast(enabled=enabled, recipe=recipe):
            y = layer(xx, top_k_index, top_k_weights)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), xx.grad))
    (y_hp, dx_hp), (y_fp8, dx_fp8) = results
    for fp8, hp in ((y_fp8, y_hp), (dx_fp8, dx_hp)):
        assert 0 < float((fp8 - hp).norm() / hp.norm()) < 0.1
    assert all(p.grad is None for p in layer.parameters())

"""Published block-FP8 checkpoints (Hugging Face `quant_method: "fp8"`, DeepSeek-V3 / Qwen3-FP8): load
them with their quantized linears as frozen `StoredFP8Linear` layers (the stored bytes, no
high-precision copy), fine-tune (LoRA on top: fp8train.integrations.peft_fp8; or fully:
`full_finetuning`), and export in the same format (docs/guide.md, "Fine-tuning an FP8 checkpoint").

Experts stored as separate linears are linears like any other. transformers' fused experts (Qwen3-MoE,
Mixtral: 3-D `gate_up_proj` / `down_proj`) load from DeepSeek-V3's per-expert layout
(`<experts>.<e>.gate_proj.weight` + `weight_scale_inv`, ... ; Mixtral's `w1`/`w3`/`w2`) as frozen
`StoredFP8Experts` and export to the same keys and bytes; 3-D FP8 tensors in a checkpoint are refused.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any, Iterator, Optional

import torch

from ..modules.grouped_experts import FusedExperts, is_hf_fused_experts
from ..modules.stored_experts import PROJECTIONS, StoredFP8Experts
from ..modules.stored_linear import BlockFP8Linear, StoredFP8Linear, exclude_stored_from_ddp
from ..quantization.stored_block_weights import (
    BLOCK,
    DEFAULT_RECIPE,
    BlockFormatError,
    check_scale_values,
    check_stored_weight,
    quantize_block_weight,
    scales_to_float32,
    scales_to_format,
)
from ..recipe import Float8BlockScaling
from ..user_warnings import warn_user
from . import require

_transformers = require("transformers", "hf", "fp8train.integrations.fp8_checkpoint")
_safetensors_torch = require("safetensors.torch", "hf", "fp8train.integrations.fp8_checkpoint")
_accelerate = require("accelerate", "hf", "fp8train.integrations.fp8_checkpoint")

__all__ = [
    "BlockFormatError",
    "load_fp8_checkpoint",
    "convert_fp8_model",
    "full_finetuning",
    "iter_fp8_weights",
    "export_fp8_checkpoint",
    "quantization_config_of",
    "exclude_stored_from_ddp",
    "SCALE_SUFFIX",
]

SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
# where a model without a transformers `.config` (a hand-built module) keeps its quantization_config
QUANTIZATION_ATTRIBUTE = "fp8_quantization_config"
DEFAULT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
}


def check_quantization_config(config: Optional[dict], where: str) -> dict:
    """The checkpoint's quantization_config, if it is one fp8train trains on as stored; else an error
    that says which field is not."""
    if not config:
        raise BlockFormatError(f"{where} has no quantization_config: it is not an FP8 checkpoint")
    config = config if isinstance(config, dict) else config.to_dict()
    checks = {
        "quant_method": ("fp8",),
        "fmt": ("e4m3",),
        "activation_scheme": ("dynamic",),
        "scale_fmt": ("float", "ue8m0"),
    }
    for key, allowed in checks.items():
        value = config.get(key, allowed[0] if key in ("fmt", "scale_fmt") else None)
        if value not in allowed:
            raise BlockFormatError(
                f"{where}: quantization_config {key}={value!r} is not supported (expected "
                f"{' or '.join(map(repr, allowed))}); static activation scales and other FP8 formats are not"
            )
    block = config.get("weight_block_size")
    if block is None or tuple(block) != BLOCK:
        raise BlockFormatError(
            f"{where}: quantization_config weight_block_size={block!r} is not Float8BlockScaling's "
            f"{list(BLOCK)}: fp8train uses stored operands of 128x128 blocks only"
        )
    return config


def quantization_config_of(model: torch.nn.Module) -> dict:
    """The quantization_config a model loaded here came with (the format's default otherwise)."""
    base = _base(model)
    config = getattr(getattr(base, "config", None), "quantization_config", None)
    config = config if config is not None else getattr(base, QUANTIZATION_ATTRIBUTE, None)
    return dict(config if isinstance(config, dict) else DEFAULT_CONFIG)


def _record_quantization(model: torch.nn.Module, quantization: dict) -> None:
    """What an export writes back: in the model's transformers config, or, for a module without
    one, in its attribute `QUANTIZATION_ATTRIBUTE`."""
    config = getattr(model, "config", None)
    if config is not None:
        config.quantization_config = quantization
    else:
        setattr(model, QUANTIZATION_ATTRIBUTE, quantization)


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (PeftModel), or `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _read_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:  # memory-mapped by safetensors: the bytes are the stored ones
        tensors.update(_safetensors_torch.load_file(os.path.join(directory, name)))
    return tensors


def _stored_layers(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, tuple]:
    """Every FP8 weight of `tensors`, checked against its scale and its module of `model`:
    {module name: (weight, float32 scale_inv, bias)}. Checks all before anything is changed."""
    layers = {}
    for key, weight in tensors.items():
        if key.endswith(SCALE_SUFFIX):
            if key[: -len(SCALE_SUFFIX)] not in tensors:
                raise BlockFormatError(f"{key} has no weight {key[: -len(SCALE_SUFFIX)]} to scale")
            continue
        one_byte_float = weight.is_floating_point() and weight.element_size() == 1
        if not one_byte_float and key + SCALE_SUFFIX not in tensors:
            continue  # a high-precision tensor (an embedding, a norm, modules_to_not_convert)
        if weight.dim() == 3:
            raise BlockFormatError(
                f"{key} is a 3-D FP8 tensor {tuple(weight.shape)}: fused expert tensors are read per expert "
                "(DeepSeek-V3's layout: <experts>.<e>.gate_proj.weight and its weight_scale_inv, up_proj, "
                "down_proj), not fused"
            )
        if not key.endswith(".weight"):
            raise BlockFormatError(f"{key} is FP8 but is not a linear layer's weight")
        name = key[: -len(".weight")]
        scale = tensors.get(key + SCALE_SUFFIX)
        check_stored_weight(key, weight, scale)
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise BlockFormatError(f"{key}: the model has no module {name!r} for it") from None
        shape = getattr(module, "weight", None)
        if not isinstance(module, (torch.nn.Linear, StoredFP8Linear)) or tuple(shape.shape) != tuple(
            weight.shape
        ):
            raise BlockFormatError(
                f"{key} {tuple(weight.shape)} does not fit the model's {name} ({type(module).__name__} "
                f"{tuple(shape.shape) if shape is not None else ''}): not a linear layer of that shape"
            )
        scale = scales_to_float32(scale, key + SCALE_SUFFIX)
        check_scale_values(scale, key + SCALE_SUFFIX)
        layers[name] = (weight, scale, tensors.get(name + ".bias"))
    return layers


# a per-expert tensor: "<experts>.<e>.<projection>.<weight | weight_scale_inv | bias>"
EXPERT_KEY = re.compile(
    r"^(?P<prefix>.+)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.(?P<suffix>weight(_scale_inv)?|bias)$"
)


def _fused_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's experts held as 3-D tensors (transformers' fused experts, converted or not)."""
    return {
        name: module
        for name, module in model.named_modules()
        if is_hf_fused_experts(module) or isinstance(module, (FusedExperts, StoredFP8Experts))
    }


def _checkpoint_prefixes(name: str) -> list[str]:
    """Where per-expert checkpoints keep the experts of the module `name`: its name, and Mixtral's
    original `block_sparse_moe.experts` for transformers' `mlp.experts`."""
    renamed = name.replace(".mlp.experts", ".block_sparse_moe.experts")
    return [name] + ([renamed] if renamed != name else [])


def _stored_experts(
    tensors: dict[str, torch.Tensor], model: torch.nn.Module, recipe
) -> tuple[dict[str, StoredFP8Experts], set[str]]:
    """The fused experts of `model` whose per-expert FP8 tensors `tensors` holds, built as
    `StoredFP8Experts` (nothing of the model changes), and the keys they took. Every tensor under an
    experts module is checked: each expert's three weights and scales present and of the format,
    every key one of theirs; else a BlockFormatError naming the tensor."""
    modules = _fused_experts(model)
    owner = {prefix: name for name in modules for prefix in _checkpoint_prefixes(name)}
    found: dict[tuple[str, str], dict[str, re.Match]] = {}
    for key in tensors:
        match = EXPERT_KEY.match(key)
        if match and match["prefix"] in owner:
            found.setdefault((owner[match["prefix"]], match["prefix"]), {})[key] = match
    built, taken = {}, set()
    for (name, prefix), keys in found.items():
        module = modules[name]
        if name in built:
            raise BlockFormatError(
                f"{next(iter(keys))}: the checkpoint holds {name}'s experts under two names "
                f"({built[name].checkpoint_prefix or name} and {prefix})"
            )
        experts = (
            module.gate_up_proj if not isinstance(module, StoredFP8Experts) else module.down_proj
        ).shape[0]
        projections = {match["proj"] for match in keys.values()}
        names = next((p for p in PROJECTIONS if projections <= set(p)), None)
        for key, match in sorted(keys.items()):
            if names is None or match["suffix"] == "bias" or int(match["expert"]) >= experts:
                raise BlockFormatError(
                    f"{key} is not a tensor of {name} ({type(module).__name__}, {experts} experts 0.."
                    f"{experts - 1}, each a weight and weight_scale_inv of "
                    f"{' or '.join('/'.join(p) for p in PROJECTIONS)}, no bias)"
                )
        per_projection = []
        for proj in names:
            tensors_of = []
            for e in range(experts):
                key = f"{prefix}.{e}.{proj}.weight"
                if key not in tensors:
                    raise BlockFormatError(
                        f"the checkpoint has no {key}: {name} has {experts} experts, each with "
                        f"{', '.join(names)} (missing expert {e})"
                    )
                tensors_of.append((tensors[key], tensors.get(key + SCALE_SUFFIX)))
            per_projection.append(tensors_of)
        stored = StoredFP8Experts.from_expert_tensors(
            *per_projection, module.act_fn, recipe=recipe, name=name, checkpoint_names=names,
            checkpoint_prefix=None if prefix == name else prefix,
        )  # fmt: skip
        if stored.down_proj.shape != module.down_proj.shape:
            raise BlockFormatError(
                f"{prefix}.0.{names[2]}.weight: the checkpoint's experts ({stored.num_experts} x "
                f"{tuple(stored.down_proj.shape[1:])} down_proj) do not fit the model's {name} "
                f"{tuple(module.down_proj.shape)}"
            )
        built[name] = stored
        taken.update(keys)
    return built, taken


def _swap_in(model: torch.nn.Module, layers: dict[str, tuple], recipe, compute_dtype, experts=None) -> None:
    new = {
        name: StoredFP8Linear(w, s, b, compute_dtype, recipe, f"{name}.weight")
        for name, (w, s, b) in layers.items()
    }
    for name, module in (experts or {}).items():
        module.compute_dtype = compute_dtype
        new[name] = module
    for name, layer in new.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer.train(getattr(parent, child).training)
        setattr(parent, child, layer)


def _build_on_meta(directory: str, model_class: Any) -> torch.nn.Module:
    """The model of `directory`'s config with its parameters on "meta" (nothing allocated) and its
    buffers real (non-persistent ones, rotary frequencies, are not in checkpoints)."""
    config = _transformers.AutoConfig.from_pretrained(directory)
    quantization = check_quantization_config(getattr(config, "quantization_config", None), directory)
    del config.quantization_config  # built plain: fp8train, not transformers, takes the FP8 layers
    with _accelerate.init_empty_weights(include_buffers=False):
        model = (model_class or _transformers.AutoModelForCausalLM).from_config(config)
    model.config.quantization_config = quantization
    return model


def load_fp8_checkpoint(
    directory: str,
    recipe: Float8BlockScaling = DEFAULT_RECIPE,
    model: Optional[torch.nn.Module] = None,
    model_class: Any = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.nn.Module:
    """The model of the block-FP8 checkpoint in `directory` (config.json + safetensors), its FP8
    linears `StoredFP8Linear` layers holding the stored bytes (frozen), everything else as stored
    (cast to `dtype` if given). `model`: a model already built for it (on "meta" or not), filled in
    place; else one is built from the config (`model_class`, default AutoModelForCausalLM) with its
    parameters on "meta" first. `recipe`: the block recipe each `StoredFP8Linear` quantizes a new
    weight with (a merged adapter; default `Float8BlockScaling()`). Every tensor is checked before
    any is used: a bad checkpoint is an error (BlockFormatError, a ValueError) naming the tensor, and
    a given `model` is left as it was. Returns the model."""
    if model is None:
        model = _build_on_meta(directory, model_class)
        quantization = model.config.quantization_config
    else:
        with open(os.path.join(directory, "config.json")) as f:
            quantization = check_quantization_config(json.load(f).get("quantization_config"), directory)
    tensors = _read_checkpoint(directory)
    experts, expert_keys = _stored_experts(tensors, model, recipe)
    tensors = {k: v for k, v in tensors.items() if k not in expert_keys}
    layers = _stored_layers(tensors, model)
    plain = {k: v for k, v in tensors.items() if k.rpartition(".")[0] not in layers}
    if dtype is not None:
        plain = {k: v.to(dtype) if v.is_floating_point() else v for k, v in plain.items()}
    expected = set(model.state_dict()) - {f"{n}.weight" for n in layers} - {f"{n}.bias" for n in layers}
    expected = {k for k in expected if not any(k.startswith(f"{n}.") for n in experts)}
    unexpected = sorted(set(plain) - expected)
    if unexpected:
        raise BlockFormatError(f"{directory} has tensors the model does not: {', '.join(unexpected[:4])}")
    missing = sorted(expected - set(plain) - set(getattr(model, "all_tied_weights_keys", None) or {}))
    if missing:  # tied weights (lm_head to the embedding) are tied again below
        raise BlockFormatError(f"{directory} has no tensor for {', '.join(missing[:4])}")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    misfit = [k for k, v in plain.items() if k in shapes and tuple(v.shape) != shapes[k]]
    if misfit:  # load_state_dict would refuse them after the FP8 layers were swapped in
        k = misfit[0]
        raise BlockFormatError(
            f"{directory}: {k} has shape {tuple(plain[k].shape)}, the model's is {shapes[k]}"
            + (f" (and {len(misfit) - 1} more)" if len(misfit) > 1 else "")
        )
    floats = [v.dtype for v in plain.values() if v.is_floating_point()]
    compute_dtype = dtype or (floats[0] if floats else torch.float32)
    _check_buffers(model, {**layers, **experts})  # the last check: the model changes from here on
    _swap_in(model, layers, recipe, compute_dtype, experts)
    model.load_state_dict(plain, strict=False, assign=True)
    _record_quantization(model, quantization)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    _materialize_buffers(model)
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise BlockFormatError(f"{directory} has no tensor for {', '.join(left[:4])}")
    return model


def _meta_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, list[str]]]:
    """(name, module, its buffers on "meta") for each module that has some."""
    for name, module in model.named_modules():
        meta = [n for n, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        if meta:
            yield name, module, meta


def _check_buffers(model: torch.nn.Module, layers: dict[str, tuple]) -> None:
    """Refuse, before the model changes, buffers on "meta" that `_materialize_buffers` cannot compute
    (those of the FP8 linears are replaced with them)."""
    for name, module, meta in _meta_buffers(model):
        if name in layers:
            continue
        if list(module.parameters(recurse=False)) or not hasattr(model, "_init_weights"):
            raise BlockFormatError(
                f"{name}'s buffers {meta} are on the meta device and not in the checkpoint: build the "
                "model with accelerate.init_empty_weights(include_buffers=False)"
            )


def _materialize_buffers(model: torch.nn.Module) -> None:
    """Buffers a meta-device build left on "meta" (non-persistent ones: no checkpoint has them),
    computed again by transformers' initialisation of their module (rotary frequencies)."""
    _check_buffers(model, {})
    for _, module, meta in _meta_buffers(model):
        for n in meta:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
        model._init_weights(module)


def convert_fp8_model(
    model: torch.nn.Module, recipe: Float8BlockScaling = DEFAULT_RECIPE, compute_dtype=None
) -> torch.nn.Module:
    """An already built model whose quantized linears hold FP8 tensors (transformers' FP8Linear:
    float8 `weight` and `weight_scale_inv`) with those layers swapped for `StoredFP8Linear`, sharing
    the very tensors (nothing copied), and its FP8 fused experts (transformers' FP8Experts: float8
    `gate_up_proj`, `down_proj` and their `*_scale_inv`) swapped for `StoredFP8Experts` likewise (an
    export writes them per expert, DeepSeek-V3's names). `recipe`: the block recipe of the new layers;
    `compute_dtype`: their high-precision dtype (default: the model's floating dtype). In place;
    returns `model`. Raises BlockFormatError for a block size other than 128x128, or FP8 experts of a
    form StoredFP8Experts does not compute (a bias, no gate, a clamped or soft-capped activation)."""
    tensors, experts = {}, {}
    for name, module in model.named_modules():
        if _is_fp8_experts(module, name):
            experts[name] = StoredFP8Experts(
                module.gate_up_proj.data, module.gate_up_proj_scale_inv.data, module.down_proj.data,
                module.down_proj_scale_inv.data, module.act_fn, recipe=recipe, name=name,
            )  # fmt: skip
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn:
            tensors[f"{name}.weight"] = weight.data
            scale = getattr(module, "weight" + SCALE_SUFFIX, None)
            if scale is not None:
                tensors[f"{name}.weight{SCALE_SUFFIX}"] = scale.data
            block = getattr(module, "block_size", None)
            if block is not None and tuple(block) != BLOCK:
                raise BlockFormatError(
                    f"{name} has block_size {block}, not Float8BlockScaling's {list(BLOCK)}"
                )
            if getattr(module, "bias", None) is not None:
                tensors[f"{name}.bias"] = module.bias.data
    layers = _stored_layers(tensors, model)
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1]
    _swap_in(model, layers, recipe, compute_dtype or (dtypes[0] if dtypes else torch.float32), experts)
    return model


def _is_fp8_experts(module: torch.nn.Module, name: str) -> bool:
    """transformers' FP8 fused experts (FP8Experts); a form StoredFP8Experts does not compute is refused."""
    cls = type(module)
    if cls.__name__ != "FP8Experts" or not cls.__module__.startswith("transformers."):
        return False
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != BLOCK:
        raise BlockFormatError(f"{name} has block_size {block}, not Float8BlockScaling's {list(BLOCK)}")
    extras = {
        "has_bias": False, "has_gate": True, "activation_scheme": "dynamic", "swiglu_alpha": None,
        "swiglu_limit": None, "gate_softcap": None, "up_softcap": None,
    }  # fmt: skip
    odd = {k: getattr(module, k, v) for k, v in extras.items() if getattr(module, k, v) != v}
    if odd:
        raise BlockFormatError(
            f"{name} (transformers' FP8Experts) has {odd}: StoredFP8Experts computes gated experts without "
            "a bias, with dynamic activation scales and a plain activation only"
        )
    return True


def full_finetuning(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Every `StoredFP8Linear` of `model` replaced by a trainable `BlockFP8Linear` whose master weight
    is the dequantized stored weight, in `dtype` (train it under Float8BlockScaling). In place.
    Fused experts (`StoredFP8Experts`) stay frozen and stored, with a warning naming them."""
    frozen = []
    for name, module in list(model.named_modules()):
        if isinstance(module, StoredFP8Linear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.to_linear(dtype))
        elif isinstance(module, StoredFP8Experts):
            frozen.append(name)
    if frozen:
        warn_user(
            f"fp8train full_finetuning: {len(frozen)} fused experts modules ({', '.join(frozen[:3])}"
            f"{', ...' if len(frozen) > 3 else ''}) stay frozen FP8 (StoredFP8Experts): trainable experts "
            "from a stored FP8 checkpoint are not supported yet; everything else trains, and the export "
            "writes the experts' stored bytes"
        )
    return model


def _adapted_weight(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """W + the active, unmerged adapters' B A (scaled) of a PEFT LoRA layer, in float32; None when
    no adapter adds anything (merged into the base already, disabled, none active, or all zero:
    B starts at zero)."""
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return None
    adapters = [a for a in module.active_adapters if a in getattr(module, "lora_A", {})]
    deltas = [module.get_delta_weight(a).float() for a in adapters]
    if not any(bool(d.any()) for d in deltas):
        return None
    return module.get_base_layer().dequantized() + sum(deltas)


def iter_fp8_weights(
    model: torch.nn.Module, recipe: Float8BlockScaling = DEFAULT_RECIPE
) -> Iterator[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
    """(name, tensor, scale_inv) for every tensor of the checkpoint `model` exports, one layer at a
    time (an RL weight sync streams these to an inference engine): a quantized layer's FP8 weight
    and its float32 scale_inv, other tensors with None. Untouched stored layers give their bytes as
    they are; trained layers (`BlockFP8Linear`) and LoRA over stored ones (W + BA, merged one layer
    at a time) are quantized by `recipe`'s weight quantizer, the one their training forward used.
    Names are the checkpoint's (no PEFT prefixes); a tied tensor is given once."""
    seen: set[int] = set()

    def walk(module: torch.nn.Module, prefix: str):
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if isinstance(module, StoredFP8Experts):  # frozen: the stored bytes, per expert
            for key, weight, scale_inv in module.expert_tensors(prefix[:-1]):
                yield key, weight.detach(), scale_inv.detach()
            return
        if isinstance(base, StoredFP8Linear) or isinstance(module, BlockFP8Linear):
            adapted = None if base is module else _adapted_weight(module)
            if isinstance(module, BlockFP8Linear):
                weight, scale_inv = quantize_block_weight(module.weight, recipe)
            elif adapted is not None:
                weight, scale_inv = quantize_block_weight(adapted, recipe)
            else:  # untouched: the stored bytes
                weight, scale_inv = base.weight.detach(), base.weight_scale_inv.detach()
            yield f"{prefix}weight", weight, scale_inv
            if base.bias is not None:
                yield f"{prefix}bias", base.bias.detach(), None
            return
        for name, tensor in list(module._parameters.items()) + [
            (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
        ]:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                yield f"{prefix}{name}", tensor.detach(), None
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(_base(model), "")


def export_fp8_checkpoint(
    model: torch.nn.Module, directory: str, recipe: Float8BlockScaling = DEFAULT_RECIPE
) -> dict:
    """Write `model` to `directory` in the block-FP8 format it was loaded from (model.safetensors and
    config.json with its quantization_config; `iter_fp8_weights` gives the tensors), loadable by
    transformers and by `load_fp8_checkpoint`; `recipe` quantizes the layers trained in high
    precision (`BlockFP8Linear`) back to block FP8. Returns the quantization_config written."""
    quantization = quantization_config_of(model)
    scale_fmt = quantization.get("scale_fmt", "float")
    tensors = {}
    for name, tensor, scale_inv in iter_fp8_weights(model, recipe):
        tensors[name] = tensor.contiguous()
        if scale_inv is not None:
            tensors[name + SCALE_SUFFIX] = scales_to_format(scale_inv, scale_fmt, name + SCALE_SUFFIX)
    os.makedirs(directory, exist_ok=True)
    _safetensors_torch.save_file(
        tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"}
    )
    if getattr(_base(model), "config", None) is None:  # a hand-built module: what model= loads back
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({"quantization_config": quantization}, f, indent=2)
        return quantization
    config = copy.deepcopy(_base(model).config)
    config.quantization_config = quantization
    config.save_pretrained(directory)
    return quantization

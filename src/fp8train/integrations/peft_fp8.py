"""PEFT's LoRA on frozen FP8 layers (`StoredFP8Linear`, a loaded block-FP8 checkpoint's linears):

    config = fp8train.integrations.peft_fp8.lora_config(r=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, config)

`lora_config` is a `peft.LoraConfig` with PEFT's custom-layer mapping (`_register_custom_module`)
from StoredFP8Linear to `FP8LoraLinear`, which is PEFT's own LoRA Linear (adapters in the layer's
`compute_dtype`, PEFT's save_pretrained) except that a merge writes W + B A back as block FP8,
requantized by the base layer's recipe. PEFT does not save the mapping: load adapters with
`load_adapter`. docs/guide.md, "Fine-tuning an FP8 checkpoint".
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..modules.stored_linear import StoredFP8Linear
from . import require

_peft = require("peft", "peft", "fp8train.integrations.peft_fp8")
_lora = require("peft.tuners.lora", "peft", "fp8train.integrations.peft_fp8")
_tuners_utils = require("peft.tuners.tuners_utils", "peft", "fp8train.integrations.peft_fp8")

__all__ = ["FP8LoraLinear", "lora_config", "register_fp8_layers", "load_adapter"]


class FP8LoraLinear(_lora.Linear):
    """PEFT's LoRA Linear over a `StoredFP8Linear`. Plain LoRA only (no DoRA or other variant, no
    lora_bias): a merge must be W + B A, which is all the FP8 base can take back.

    PEFT builds it (`register_fp8_layers` maps `StoredFP8Linear` to it), with PEFT's `lora.Linear`
    arguments: `base_layer` (the StoredFP8Linear), `adapter_name`, `config` (the LoraConfig), `r`,
    `lora_alpha`, `is_target_conv_1d_layer` (False here) and PEFT's other keyword arguments.

    Raises:
        ValueError: DoRA, lora_bias or another LoRA variant is asked for.
    """

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: Any, **kwargs) -> None:
        """PEFT's `update_layer` (add adapter `adapter_name` of rank `r`, scaled by `lora_alpha`, per
        `config`), refusing what an FP8 base cannot merge back (a ValueError)."""
        if getattr(config, "use_dora", False) or getattr(config, "lora_bias", False):
            raise ValueError(
                "LoRA on an FP8 layer (StoredFP8Linear) supports plain LoRA only: set use_dora=False "
                "and lora_bias=False"
            )
        super().update_layer(adapter_name, r, lora_alpha, config=config, **kwargs)
        if self.lora_variant.get(adapter_name) is not None:
            raise ValueError(
                f"LoRA variant {type(self.lora_variant[adapter_name]).__name__} is not supported on an FP8 "
                "layer (StoredFP8Linear): use plain LoRA"
            )

    def _get_in_out_features(self, module: torch.nn.Module) -> tuple:
        """The base layer's dimensions, through the hook PEFT's LoRA layers override for base layers
        its table does not name (its ParamWrapper does the same): without it PEFT reads the same
        `in_features` / `out_features` but first warns "Unsupported layer type StoredFP8Linear ...
        proceed at your own risk" once per layer on every rank."""
        if isinstance(module, StoredFP8Linear):
            return module.in_features, module.out_features
        return super()._get_in_out_features(module)

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """W + sum of B A (scaled) over the adapters (`adapter_names`, default: the active ones),
        quantized to block FP8 by the base layer's recipe and stored in its place (the merge is lossy
        by that rounding, so it cannot be undone). `safe_merge` is PEFT's argument: the merged weight
        is always checked for non-finite values (a ValueError, nothing merged)."""
        adapter_names = _tuners_utils.check_adapters_to_merge(self, adapter_names)
        adapter_names = [a for a in adapter_names if a in self.lora_A]
        if not adapter_names:
            return
        base = self.get_base_layer()
        weight = base.dequantized()
        for adapter in adapter_names:
            weight += self.get_delta_weight(adapter).float()
        if not torch.isfinite(weight).all():
            raise ValueError(
                f"non-finite values in the merged weight of adapters {adapter_names}: not merged"
            )
        base.set_weight(weight)
        self.merged_adapters.extend(adapter_names)

    def unmerge(self) -> None:
        raise RuntimeError(
            "an adapter merged into an FP8 layer cannot be unmerged (the merge requantized the weight): "
            "load the checkpoint again"
        )


def register_fp8_layers(config: Any) -> Any:
    """`config` (a peft.LoraConfig) with StoredFP8Linear layers mapped to FP8LoraLinear."""
    config._register_custom_module({StoredFP8Linear: FP8LoraLinear})
    return config


def lora_config(**kwargs: Any) -> Any:
    """`peft.LoraConfig(**kwargs)` that targets StoredFP8Linear layers too."""
    return register_fp8_layers(_peft.LoraConfig(**kwargs))


def load_adapter(model: torch.nn.Module, directory: str, **kwargs: Any) -> torch.nn.Module:
    """`peft.PeftModel.from_pretrained(model, directory)` for adapters trained on FP8 layers."""
    config = register_fp8_layers(_peft.LoraConfig.from_pretrained(directory))
    return _peft.PeftModel.from_pretrained(model, directory, config=config, **kwargs)

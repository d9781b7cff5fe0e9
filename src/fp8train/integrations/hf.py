"""Hugging Face `transformers` (Trainer) and `accelerate`: `model = fp8train.prepare(model)` is all
training needs (docs/guide.md, "Hugging Face Trainer and accelerate"). This module adds the way back:
`from_pretrained` loads a model saved by `save_pretrained` / `Trainer.save_model` with its FP8 state,
which a plain `from_pretrained` drops (it builds the unconverted model, which has no FP8 modules).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from ..convert import FilterFn
from ..modules.base import FP8Module
from ..prepare import prepare as _prepare
from ..recipe import Recipe
from ..user_warnings import UNSET, renamed_argument
from . import require

require("transformers", "hf", "fp8train.integrations.hf")
_safetensors = require("safetensors.torch", "hf", "fp8train.integrations.hf")

__all__ = ["from_pretrained", "load_fp8_state"]

EXTRA_STATE = "._extra_state"


def load_fp8_state(model: torch.nn.Module, directory: str) -> int:
    """Load the FP8 state (the `_extra_state` entries) saved in `directory`'s safetensors files into a
    prepared `model`; returns how many modules got theirs. Every FP8 module must find its entry."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{directory} holds no .safetensors file: save with save_pretrained / save_model"
        )
    extra = {}
    for name in files:
        for key, value in _safetensors.load_file(os.path.join(directory, name)).items():
            if key.endswith(EXTRA_STATE):
                extra[key] = value
    expected = {f"{n}{EXTRA_STATE}" for n, m in model.named_modules() if isinstance(m, FP8Module)}
    missing = sorted(expected - set(extra))
    if missing:
        raise ValueError(
            f"{directory} has no FP8 state for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: "
            "it was saved from a model that was not prepared the same way (same module_filter_fn)"
        )
    model.load_state_dict({k: extra[k] for k in expected}, strict=False)
    return len(expected)


def from_pretrained(
    model_class: Any,
    directory: str,
    recipe: Optional[Recipe] = None,
    amax_reduction_group: Any = None,
    module_filter_fn: Optional[FilterFn] = None,
    *,
    filter_fn: Any = UNSET,
    **kwargs: Any,
) -> torch.nn.Module:
    """`model_class.from_pretrained(directory, **kwargs)`, prepared, with the saved FP8 state loaded:
    the model `Trainer.save_model(directory)` saved, ready to train on (or evaluate) in FP8.

    Args:
        model_class: a transformers model class (`AutoModelForCausalLM`, `GPT2LMHeadModel`, ...).
        directory: what `save_pretrained` / `Trainer.save_model` wrote (safetensors files).
        recipe: the recipe of `fp8train.prepare` (default `DelayedScaling()`): the run's.
        amax_reduction_group: as `fp8train.prepare` (default: the world).
        module_filter_fn: as `fp8train.prepare`; the run's, so that the same layers hold FP8 state.
        filter_fn: the deprecated name of `module_filter_fn` (a DeprecationWarning).
        **kwargs: passed to `model_class.from_pretrained`.

    Returns:
        The prepared model, its FP8 state loaded.

    Raises:
        FileNotFoundError: `directory` holds no safetensors file.
        ValueError: an FP8 module finds no FP8 state in `directory` (saved from a model prepared with
            another filter).
    """
    module_filter_fn = renamed_argument(
        module_filter_fn,
        filter_fn,
        "module_filter_fn",
        "filter_fn",
        "fp8train.integrations.hf.from_pretrained",
    )
    model = model_class.from_pretrained(directory, **kwargs)
    model = _prepare(
        model, recipe=recipe, amax_reduction_group=amax_reduction_group, module_filter_fn=module_filter_fn
    )
    load_fp8_state(model, directory)
    return model

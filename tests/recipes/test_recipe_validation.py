"""Recipe validation: every invalid field is a ValueError naming the field and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fp8train
from fp8train import DelayedScaling, Format
from fp8train.recipe import fp8_dtype, fp8_max


def test_defaults_are_transformer_engine_defaults() -> None:
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len) == (0, Format.HYBRID, 1024)
    assert r.amax_compute_algo == "max"
    assert r.scaling_factor_compute_algo is None and r.reduce_amax is True
    assert fp8train.recipe.DelayedScaling is DelayedScaling and fp8train.recipe.Format is Format


def test_formats() -> None:
    assert (Format.HYBRID.fwd, Format.HYBRID.bwd) == ("e4m3", "e5m2")
    assert (Format.E4M3.fwd, Format.E4M3.bwd) == ("e4m3", "e4m3")
    assert (fp8_max("e4m3"), fp8_max("e5m2")) == (448.0, 57344.0)
    assert fp8_dtype("e4m3") == torch.float8_e4m3fn and fp8_dtype("e5m2") == torch.float8_e5m2
    # fp8_max is the largest finite value of each dtype
    assert torch.finfo(torch.float8_e4m3fn).max == 448.0 and torch.finfo(torch.float8_e5m2).max == 57344.0


def test_valid_values_are_accepted() -> None:
    def algo(h):
        return h.amax(0)

    def sf(amax, scale, m, recipe):
        return m / amax

    r = DelayedScaling(
        margin=3,
        fp8_format=Format.E4M3,
        amax_history_len=1,
        amax_compute_algo=algo,
        scaling_factor_compute_algo=sf,
        reduce_amax=False,
    )
    assert r.amax_compute_algo is algo and r.scaling_factor_compute_algo is sf
    DelayedScaling(amax_compute_algo="most_recent")
    hash(r)  # recipes key the amax groups


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        ({"margin": -1}, "margin", ">= 0"),
        ({"margin": 1.5}, "margin", ">= 0"),
        ({"margin": True}, "margin", ">= 0"),
        ({"amax_history_len": 0}, "amax_history_len", ">= 1"),
        ({"amax_history_len": -4}, "amax_history_len", ">= 1"),
        ({"amax_history_len": 16.0}, "amax_history_len", ">= 1"),
        ({"amax_history_len": "16"}, "amax_history_len", ">= 1"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo", "'max', 'most_recent' or a callable"),
        ({"amax_compute_algo": None}, "amax_compute_algo", "'max', 'most_recent' or a callable"),
        ({"scaling_factor_compute_algo": 2.0}, "scaling_factor_compute_algo", "None or a callable"),
        ({"scaling_factor_compute_algo": "max"}, "scaling_factor_compute_algo", "None or a callable"),
        ({"fp8_format": Format.E5M2}, "fp8_format", "Format.E4M3 or Format.HYBRID"),
        ({"fp8_format": "HYBRID"}, "fp8_format", "Format.E4M3 or Format.HYBRID"),
        ({"fp8_format": ("e4m3", "e5m2")}, "fp8_format", "Format.E4M3 or Format.HYBRID"),
        ({"reduce_amax": "yes"}, "reduce_amax", "True or False"),
        ({"margin": 0.5}, "margin", ">= 0"),
        ({"amax_history_len": 2.0}, "amax_history_len", ">= 1"),
        ({"fp8_format": "e4m3"}, "fp8_format", "Format.E4M3 or Format.HYBRID"),
    ],
)
def test_invalid_field_names_field_and_allowed_values(kwargs: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        DelayedScaling(**kwargs)
    message = str(info.value)
    assert f"DelayedScaling.{field} must be" in message
    assert allowed in message
    assert repr(next(iter(kwargs.values()))) in message  # and the offending value


def test_recipe_is_immutable() -> None:
    r = DelayedScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 2  # type: ignore[misc]


def test_recipe_of_the_wrong_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="fp8_recipe must be a fp8train.DelayedScaling"):
        with fp8train.fp8_autocast(fp8_recipe={"margin": 0}):
            pass
    assert fp8train.inspection.open_regions() == 0

"""torchtitan: a model converter for torchtitan's config-tree interface (torchtitan >= 0.3).

torchtitan's converters (`torchtitan.protocols.model.ModelConfigConverter`, such as its
`Float8LinearConverter`) rewrite the model's config tree before the model is built on the meta
device: `convert(model_config) -> model_config`. `FP8TrainConverter` does two things there:

- every `Linear.Config` whose dimensions are multiples of 16 and whose name matches none of
  `filter_fqns` (default: the output head, `lm_head`) becomes an `FP8Linear.Config`: torchtitan's
  own Linear (same parameters, names, initialisation and sharding hooks) with fp8train's FP8 GEMMs;
  every `GroupedExperts.Config` (MoE experts, 3-D weights) likewise becomes an
  `FP8GroupedExperts.Config`: one FP8 GEMM per expert and weight (docs/design.md, section 9);
- the root config is replaced by a subclass of its own class whose `build()` also makes the model's
  forward one FP8 region (`fp8train.prepare`'s `FP8Forward`): each microbatch torchtitan runs is one
  region, with one amax reduction per direction.

Configure it in a config_registry function: `model_registry(..., converters=[FP8TrainConverter.Config()])`
(docs/guide.md, "torchtitan").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..convert import fp8_compatible
from ..debug_switches import SWITCHES
from ..fsdp import wrap_for_fsdp
from ..layer_coverage import log_coverage
from ..modules.base import FP8Module
from ..modules.fp8_linear import fp8_linear
from ..modules.grouped_experts import grouped_linear
from ..prepare import FP8Forward, is_prepared
from ..quantization import quantization_of
from ..recipe import DelayedScaling, Format
from ..runtime import current_settings
from . import require

_protocols = require("torchtitan.protocols.model", "torchtitan", "fp8train.integrations.torchtitan")
_TitanLinear = require(
    "torchtitan.models.common.linear", "torchtitan", "fp8train.integrations.torchtitan"
).Linear

_TitanGroupedExperts = require(
    "torchtitan.models.common.moe", "torchtitan", "fp8train.integrations.torchtitan"
).GroupedExperts

__all__ = ["FP8TrainConverter", "FP8Linear", "FP8GroupedExperts", "converted_fqns"]


class FP8Linear(FP8Module, _TitanLinear):
    """torchtitan's Linear (its parameters, names, initialisation and parallelize hooks) with fp8train's
    FP8 GEMMs inside an FP8 region; outside one it computes exactly as torchtitan's Linear. Built by
    torchtitan from `config` (torchtitan's Linear.Config, plus `fsdp_fp8_all_gather`: FSDP2 gathers
    the weight in FP8)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanLinear.Config):
        fsdp_fp8_all_gather: bool = False

    def __init__(self, config: Config) -> None:
        _TitanLinear.__init__(self, config)  # torch.nn.Linear's init, through torchtitan's
        self.init_fp8_state()
        if config.fsdp_fp8_all_gather:
            wrap_for_fsdp(self.weight, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias for `x` (..., in_features): FP8 inside a region, high precision outside."""
        return fp8_linear(self, x, self.weight, self.bias, 0, None)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local tensor, differentiably (as torchtitan's experts take it)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class FP8GroupedExperts(FP8Module, _TitanGroupedExperts):
    """torchtitan's GroupedExperts (w1_EFD, w2_EDF, w3_EFD: (experts, out, in) each, its initialisation
    and sharding hooks) with one FP8 GEMM per expert and weight inside an FP8 region: w1's experts are
    GEMMs 0..E-1, w3's E..2E-1, w2's 2E..3E-1, each with its own roles. Outside a region (or held in
    high precision by a switch) it runs torchtitan's own forward, bit for bit. `config`: torchtitan's
    GroupedExperts config (the number of experts, dimensions and initialisation), plus
    `fsdp_fp8_all_gather`: FSDP2 gathers each expert's weights in FP8 with its GEMM's scale."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanGroupedExperts.Config):
        fsdp_fp8_all_gather: bool = False

    def __init__(self, config: Config) -> None:
        _TitanGroupedExperts.__init__(self, config)
        experts = config.num_experts
        self.num_gemms = 3 * experts  # before init_fp8_state: it sizes the role layout
        self.gemm_names = tuple(f"{w}_{e}" for w in ("w1", "w3", "w2") for e in range(experts))
        self.init_fp8_state()
        if config.fsdp_fp8_all_gather:  # 3-D weights: expert e of each is GEMM first + e (fsdp.py)
            for first, weight in enumerate((self.w1_EFD, self.w3_EFD, self.w2_EDF)):
                wrap_for_fsdp(weight, first * experts)

    def gemm_weights(self) -> list[torch.Tensor]:
        """The weight of each GEMM, in GEMM order (one per expert): what the module casts to FP8."""
        weights = (self.w1_EFD, self.w3_EFD, self.w2_EDF)
        return [w for weight in weights for w in _local(weight).detach().unbind(0)]

    def gemm_tokens(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor, *args) -> list[int]:
        """The rows each GEMM multiplies in a call `forward(x, num_tokens_per_expert)`."""
        return num_tokens_per_expert.tolist() * 3

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """torchtitan's call: `x_RD` (routed tokens, dim) grouped by expert, `num_tokens_per_expert_E`
        (experts,) the tokens of each; silu(x w1) * (x w3) then w2, per expert. Returns (tokens, dim)."""
        settings = current_settings()
        if settings is None or not settings.active or SWITCHES.high_precision_now(self):
            return _TitanGroupedExperts.forward(self, x_RD, num_tokens_per_expert_E)
        w1, w2, w3 = _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        experts, x = self.num_experts, x_RD.to(w1.dtype)
        gate = grouped_linear(self, x, w1, offs, None, 0, pad_to_blocks=True)
        up = grouped_linear(self, x, w3, offs, None, experts, pad_to_blocks=True)
        return grouped_linear(
            self, F.silu(gate) * up, w2, offs, None, 2 * experts, pad_to_blocks=True
        ).type_as(x_RD)


def _fp8_root(config_cls: type, recipe: DelayedScaling) -> type:
    """A subclass of the root config class whose build() returns the model with its forward in one FP8
    region under `recipe`: a subclass, so every isinstance check and method of torchtitan's trainer
    still applies, and `dataclasses.replace` of it keeps the recipe (a class attribute: slots)."""

    class FP8Root(config_cls):
        __slots__ = ()
        fp8_recipe: ClassVar[DelayedScaling] = recipe

        def build(self, **kwargs: Any):
            model = config_cls.build(self, **kwargs)
            if not is_prepared(model):
                quantization = quantization_of(self.fp8_recipe)
                model.forward = FP8Forward(model, quantization, None)
                log_coverage(model, type(quantization))  # once per model built
            return model

    FP8Root.__name__ = FP8Root.__qualname__ = "FP8" + config_cls.__qualname__.replace(".", "")
    return FP8Root


class FP8TrainConverter(_protocols.ModelConfigConverter):
    """Delayed-scaling FP8 training with fp8train (asynchronous amax reduction, FP8 FSDP2 gathers): a
    torchtitan model converter, built by torchtitan from `config` (its `Config`: the fields below).

    Raises:
        ValueError: `config.fp8_format` is neither "HYBRID" nor "E4M3".
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_protocols.ModelConfigConverter.Config):
        filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
        """Linear layers whose name contains any of these stay in high precision (the output head by
        default); layers with a dimension that is not a multiple of 16 always do."""

        amax_history_len: int = 1024
        amax_compute_algo: str = "max"
        margin: int = 0
        fp8_format: str = "HYBRID"
        """"HYBRID" (E4M3 forward, E5M2 gradients) or "E4M3"."""

        fsdp_fp8_all_gather: bool = False
        """FSDP2 all-gathers the converted weights as FP8 (1 byte per value) inside the region."""

    def __init__(self, config: Config) -> None:
        if config.fp8_format not in ("HYBRID", "E4M3"):
            raise ValueError(f'fp8_format must be "HYBRID" or "E4M3", got {config.fp8_format!r}')
        self.config = config
        self.recipe = DelayedScaling(
            fp8_format=getattr(Format, config.fp8_format),
            margin=config.margin,
            amax_history_len=config.amax_history_len,
            amax_compute_algo=config.amax_compute_algo,
        )

    def keeps(self, fqn: str, in_features: int, out_features: int) -> bool:
        """Whether the linear layer `fqn` of `in_features` x `out_features` is converted: both multiples
        of 16, and no `filter_fqns` entry in its name."""
        return fp8_compatible(in_features, out_features) and not any(
            f in fqn for f in self.config.filter_fqns
        )

    def convert(self, model_config: Any) -> Any:
        """`model_config` (a torchtitan model config) with its plain Linear configs that `keeps` replaced
        by `FP8Linear.Config`, as a subclass whose `build()` runs the model's forward in one FP8 region.
        Raises ValueError for a config converted already, a bare Linear, or nothing to convert."""
        if hasattr(type(model_config), "fp8_recipe"):
            raise ValueError(
                "this model config has been converted by FP8TrainConverter already: list it once"
            )
        converted = 0
        for fqn, linear, parent, attr in list(model_config.traverse(_TitanLinear.Config)):
            # a subclass (a row-parallel or soft-capped Linear, a scaled bias) has a forward or fields
            # of its own that FP8Linear would drop: it stays as it is
            if type(linear) is not _TitanLinear.Config or not self.keeps(
                fqn, linear.in_features, linear.out_features
            ):
                continue
            new = FP8Linear.Config(
                in_features=linear.in_features,
                out_features=linear.out_features,
                bias=linear.bias,
                param_init=linear.param_init,
                sharding_config=linear.sharding_config,
                fsdp_fp8_all_gather=self.config.fsdp_fp8_all_gather,
            )
            if parent is None:
                raise ValueError("FP8TrainConverter converts models, not a bare Linear config")
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            converted += 1
        for fqn, experts, parent, attr in list(model_config.traverse(_TitanGroupedExperts.Config)):
            if type(experts) is not _TitanGroupedExperts.Config or not self.keeps(
                fqn, experts.dim, experts.hidden_dim
            ):
                continue
            new = FP8GroupedExperts.Config(
                **{f.name: getattr(experts, f.name) for f in fields(experts) if f.init},
                fsdp_fp8_all_gather=self.config.fsdp_fp8_all_gather,
            )
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            converted += 1
        if converted == 0:
            raise ValueError(
                "FP8TrainConverter found no Linear to convert: every one is filtered (filter_fqns="
                f"{self.config.filter_fqns}) or has a dimension that is not a multiple of 16"
            )
        root_cls = _fp8_root(type(model_config), self.recipe)
        return root_cls(**{f.name: getattr(model_config, f.name) for f in fields(model_config) if f.init})


def converted_fqns(model: torch.nn.Module) -> list[str]:
    """Names of the modules of `model` that train in FP8 (for logs and tests)."""
    return [n for n, m in model.named_modules() if isinstance(m, FP8Module)]

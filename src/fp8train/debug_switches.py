"""Switches for bisecting a divergence: chosen FP8 layers run in high precision for a range of steps.

A rule is `PATTERN[:START-STOP]`: the FP8 modules whose name in the model matches PATTERN (shell
wildcards, `fnmatch`: "blocks.3.*", "*.mlp.*") run in high precision (their GEMMs in the parameter
dtype, recording no amax) while the step is in [START, STOP) (STOP left out: to the end; no range:
every step). Rules are separated by commas. They come from the environment variable
`FP8TRAIN_HIGH_PRECISION` (read when `convert_to_fp8` or `prepare` converts a model: no code
change), or from `high_precision(model, rules)` (a config). The step is the number of optimizer
steps taken since the first switch was applied (`torch.optim`'s global step hook counts them; with
several optimizers, the most any live one has taken), so step 0 is the first. Telemetry records
which layers ran in high precision in each logged step (layer_coverage.StepCoverage). Eager calls
only: a compiled graph keeps the precision it was traced with.

A pattern that matches no FP8 layer of the model is an error on both paths (a typo in a bisection
would otherwise leave the whole model in FP8), checked before any rule is applied; the one exception
is the variable read while a pipeline stage is prepared (`pipeline.prepare_stage`), whose module
holds only some of the layers: a pattern may name another stage's, so there it is a warning.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Rule", "parse_rules", "high_precision", "Switches", "SWITCHES", "ENV_HIGH_PRECISION"]

ENV_HIGH_PRECISION = "FP8TRAIN_HIGH_PRECISION"


@dataclass(frozen=True)
class Rule:
    pattern: str
    start: int = 0
    stop: Optional[int] = None  # exclusive; None: no end

    def covers(self, step: int) -> bool:
        """Whether optimizer step `step` is in [start, stop)."""
        return self.start <= step and (self.stop is None or step < self.stop)


def parse_rules(spec: str, where: str = "high_precision rules") -> tuple[Rule, ...]:
    """Rules from `spec`, "PATTERN[:START-STOP],...", e.g. "blocks.3.*:100-200,head"; `where` names the
    source in error messages (a ValueError that says what to write)."""
    rules = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        pattern, _, steps = part.partition(":")
        start, stop = 0, None
        if steps:
            first, dash, last = steps.partition("-")
            try:
                start = int(first) if first.strip() else 0
                stop = int(last) if last.strip() else None
            except ValueError:
                raise ValueError(
                    f"{where}: {part!r} has step range {steps!r}; write PATTERN:START-STOP with integer "
                    "steps (e.g. blocks.3.*:100-200), PATTERN:START- or PATTERN alone"
                ) from None
            if not dash or start < 0 or (stop is not None and stop <= start):
                raise ValueError(
                    f"{where}: {part!r} is not PATTERN:START-STOP with 0 <= START < STOP "
                    "(e.g. blocks.3.*:100-200)"
                )
        if not pattern.strip():
            raise ValueError(
                f"{where}: {part!r} has no layer name pattern before ':'; write PATTERN:START-STOP"
            )
        rules.append(Rule(pattern.strip(), start, stop))
    return tuple(rules)


class Switches:
    """The one registry of high-precision switches: the rules that hold each FP8 module (weakly, by
    module), and the optimizer steps taken in this process."""

    def __init__(self) -> None:
        self._rules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> rules
        self._steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> steps taken
        self._hook = None
        self._stages = 0  # > 0 while a pipeline stage is prepared (`converting_a_stage`)

    @contextlib.contextmanager
    def converting_a_stage(self):
        """While a pipeline stage is prepared: an environment pattern matching none of its layers is
        a warning (another stage may hold them), not an error."""
        self._stages += 1
        try:
            yield
        finally:
            self._stages -= 1

    def apply(self, model: torch.nn.Module, rules: tuple[Rule, ...]) -> list[str]:
        """Hold the FP8 modules of `model` whose names match `rules` (replacing their earlier rules);
        returns the names matched."""
        matched = []
        for fqn, module in model.named_modules():
            # an FP8Module (modules/base.py, a layer above: not imported) has its handle in its own
            # __dict__; a wrapper that forwards attributes (checkpoint_wrapper, torch.compile's
            # OptimizedModule, FSDP1) does not, and its inner FP8 module is matched by its own name
            if "fp8_handle" not in vars(module):
                continue
            mine = tuple(r for r in rules if fnmatch.fnmatchcase(fqn, r.pattern))
            if mine:
                self._rules[module] = mine
                matched.append(fqn)
            else:
                self._rules.pop(module, None)
        if matched and self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook  # public, documented

            self._hook = register_optimizer_step_post_hook(self._count_step)
        return matched

    def _count_step(self, optimizer, args, kwargs) -> None:
        self._steps[optimizer] = self._steps.get(optimizer, 0) + 1

    @property
    def step(self) -> int:
        """Optimizer steps counted so far (the most any live optimizer has taken)."""
        return max(self._steps.values(), default=0)

    def high_precision_now(self, module: torch.nn.Module) -> bool:
        """Whether a switch holds `module` in high precision at this step."""
        if self._hook is None:  # no rule matched a module yet (every FP8 call asks: no weak reference)
            return False
        rules = self._rules.get(module)
        return bool(rules) and any(rule.covers(self.step) for rule in rules)

    def rules_of(self, module: torch.nn.Module) -> tuple[Rule, ...]:
        """The rules that hold `module` (none: ())."""
        return self._rules.get(module, ())


SWITCHES = Switches()


def _unmatched(model: torch.nn.Module, rules: tuple[Rule, ...]) -> list[str]:
    """The patterns of `rules` that match the name of no FP8 layer of `model` (as `Switches.apply`
    names them)."""
    names = [fqn for fqn, module in model.named_modules() if "fp8_handle" in vars(module)]
    return [r.pattern for r in rules if not any(fnmatch.fnmatchcase(n, r.pattern) for n in names)]


def _no_match_message(where: str, unmatched: list[str], model: torch.nn.Module) -> str:
    return (
        f"{where}: pattern(s) {unmatched} match no FP8 layer of this {type(model).__name__}; "
        "fp8train.coverage(model).table() lists the layers by name"
    )


def high_precision(model: torch.nn.Module, rules: str) -> list[str]:
    """Run the FP8 layers of `model` that `rules` name ("blocks.3.*:100-200,...") in high precision
    for those steps; returns the names of the layers matched (a pattern matching none raises, and
    then no rule is applied)."""
    parsed = parse_rules(rules)
    unmatched = _unmatched(model, parsed)
    if unmatched:
        raise ValueError(_no_match_message("high-precision rules", unmatched, model))
    return SWITCHES.apply(model, parsed)


def apply_environment(model: torch.nn.Module) -> list[str]:
    """`high_precision(model, $FP8TRAIN_HIGH_PRECISION)` when the variable is set (convert_to_fp8,
    prepare): a pattern matching no FP8 layer raises as there, except while a pipeline stage is
    prepared (`Switches.converting_a_stage`), where it warns."""
    spec = os.environ.get(ENV_HIGH_PRECISION, "").strip()
    if not spec:
        return []
    parsed = parse_rules(spec, ENV_HIGH_PRECISION)
    unmatched = _unmatched(model, parsed)
    if unmatched:
        message = _no_match_message(ENV_HIGH_PRECISION, unmatched, model)
        if not SWITCHES._stages:
            raise ValueError(message)
        warnings.warn(
            f"{message} (this pipeline stage's: another stage may hold them)", UserWarning, stacklevel=2
        )
    return SWITCHES.apply(model, parsed)

"""Who holds what in the amax protocol (docs/design.md, sections 2 and 3; issue 40, item 2):

- the amax group's process group is kept by the `AmaxGroup` alone: a region's settings hold the
  recipe's state (the amax group), looked up at the region's entry, and ask it; a `Channel` keeps
  no process group;
- the channel calls nothing of reduction.py: `Direction.launch` finishes the directions whose
  launches the channel's verdict folds (`Channel.unfinished_before_launch`), not the channel.
"""

from __future__ import annotations

import ast
import pathlib

import fp8train
from fp8train import amax, runtime
from fp8train.amax import channel as channel_module
from fp8train.amax import state as state_module
from fp8train.runtime import state as runtime_state

AMAX = pathlib.Path(amax.__file__).parent


def test_a_delayed_region_holds_its_state_and_asks_it_for_the_process_group() -> None:
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    with fp8train.fp8_autocast(fp8_recipe=recipe):
        settings = runtime.current_settings()
        with fp8train.fp8_autocast(enabled=False, fp8_recipe=recipe):
            inactive = runtime.current_settings()
    assert settings.state is fp8train.inspection.amax_group(recipe).group
    assert settings.group is settings.state.process_group  # asked, not stored
    assert "group" not in {f.name for f in runtime_state.RegionSettings.__dataclass_fields__.values()}
    assert inactive.state is None and inactive.group is None  # inactive: no lookup

    with fp8train.fp8_autocast(fp8_recipe=fp8train.Float8CurrentScaling()):
        stateless = runtime.current_settings()
    assert stateless.state is None  # a recipe without amax groups looks none up


def test_a_channel_keeps_no_process_group() -> None:
    channel = channel_module.Channel()
    assert not hasattr(channel, "process_group")


def test_the_channel_calls_no_wait_of_reduction() -> None:
    tree = ast.parse((AMAX / "channel.py").read_text(encoding="utf-8"))
    called = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert "finish" not in called
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "reduction" not in imported


def test_one_state_lookup_at_entry_even_when_nested() -> None:
    """The entry looks the group up once per fp8_autocast entry (nested entries: their own recipe)."""
    calls = []
    original = state_module.AmaxGroups.of

    def counted(self, recipe, process_group):
        calls.append(recipe)
        return original(self, recipe, process_group)

    outer, inner = fp8train.DelayedScaling(amax_history_len=4), fp8train.DelayedScaling(amax_history_len=8)
    state_module.AmaxGroups.of = counted
    try:
        with fp8train.fp8_autocast(fp8_recipe=outer):
            with fp8train.fp8_autocast(fp8_recipe=inner):
                settings = runtime.current_settings()
    finally:
        state_module.AmaxGroups.of = original
    assert calls == [outer, inner]
    assert settings.state.recipe is inner

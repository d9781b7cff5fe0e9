"""The API reference builds, and documents every public name: a broken reference fails here.

The reference is pdoc's HTML of the public modules (fp8train/tools/api_reference.py, docs/api.md).
Checked: the build (into a temporary directory, offline: pdoc reads the imported modules), a page
entry (an anchor) for every name each public module lists in `__all__` and for every parameter of
its signature; every parameter of every public function, class and public method named in its
docstring (`check_docstrings`), which a planted undocumented parameter shows the check can fail;
`fp8_autocast`'s docstring names the five recipes. The integrations are checked where their
framework is installed (they import it).
"""

from __future__ import annotations

import html
import importlib
import inspect
import re
import sys
import types

import pytest

import fp8train
from fp8train.tools import api_reference

pytest.importorskip("pdoc", reason='the reference is built by pdoc: pip install "fp8train[docs]"')


def _entries(page: str) -> set[str]:
    """The anchors (page entries) of a pdoc page: `id="Name"`, `id="Name.method"`."""
    return set(re.findall(r'id="([A-Za-z_][\w.]*)"', page))


def _check_pages(pages: dict, modules) -> list[str]:
    problems = []
    for name in modules:
        page = pages[name]
        text = html.unescape(re.sub(r"<[^>]+>", "", page))
        entries = _entries(page)
        for public, obj in api_reference.public_names(importlib.import_module(name)):
            if public not in entries:
                problems.append(f"{name}: no page entry for {public}")
                continue
            for parameter in api_reference._parameters(obj) if callable(obj) else []:
                if parameter not in text:
                    problems.append(f"{name}.{public}: parameter {parameter} not on the page")
    return problems


def _build(tmp_path, modules) -> dict:
    written = api_reference.build(tmp_path, modules)
    assert written[0] == tmp_path / "index.html" and written[0].stat().st_size > 0
    return {name: (tmp_path / (name.replace(".", "/") + ".html")).read_text() for name in modules}


def test_the_reference_builds_with_an_entry_for_every_public_name(tmp_path) -> None:
    modules = [*api_reference.PUBLIC_MODULES, *api_reference.PAGE_ONLY]
    pages = _build(tmp_path, modules)
    assert _check_pages(pages, api_reference.PUBLIC_MODULES) == []
    assert 'href="fp8train/amax.html"' in pages["fp8train"]  # the root page links its submodules' pages
    index = (tmp_path / "index.html").read_text()
    assert all(f'href="{name.replace(".", "/")}.html"' in index for name in modules)


def test_every_public_parameter_is_documented() -> None:
    assert api_reference.check_docstrings(api_reference.PUBLIC_MODULES) == []


@pytest.mark.integration
def test_the_integrations_are_documented_where_installed(tmp_path) -> None:
    found = api_reference.available_integrations()
    if not found:
        pytest.skip("no framework integration is installed here")
    assert api_reference.check_docstrings(found) == []
    assert _check_pages(_build(tmp_path, found), found) == []


def test_the_check_finds_an_undocumented_parameter(monkeypatch, tmp_path) -> None:
    planted = types.ModuleType("fp8train_planted", "A planted module.")

    def documented(model, recipe=None):
        """Train `model` under `recipe`."""

    def undocumented(model, recipe=None):
        """Train `model`."""

    class Layer:
        """A layer of `width`."""

        def __init__(self, width: int, depth: int) -> None:
            pass

    planted.documented, planted.undocumented, planted.Layer = documented, undocumented, Layer
    planted.__all__ = ["documented", "undocumented", "Layer", "missing_from_page"]
    monkeypatch.setitem(sys.modules, "fp8train_planted", planted)
    planted.missing_from_page = documented
    assert api_reference.check_docstrings(["fp8train_planted"]) == [
        "fp8train_planted.undocumented: parameters not named in its docstring: recipe",
        "fp8train_planted.Layer: parameters not named in its docstring: depth",
    ]
    planted.__all__ = ["documented", "absent"]
    planted.absent = None
    pages = _build(tmp_path, ["fp8train_planted"])
    assert _check_pages(pages, ["fp8train_planted"]) == []  # a constant None: an entry of its own
    del planted.absent
    planted.__all__ = ["documented"]
    page = pages["fp8train_planted"].replace('id="documented"', 'id="other"')
    assert _check_pages({"fp8train_planted": page}, ["fp8train_planted"]) == [
        "fp8train_planted: no page entry for documented"
    ]


def test_fp8_autocast_names_the_five_recipes() -> None:
    recipes = [t.__name__ for t in fp8train.recipe.RECIPE_TYPES]
    assert len(recipes) == 5
    for function in (fp8train.fp8_autocast, fp8train.autocast, fp8train.prepare):
        doc = inspect.getdoc(function)
        assert all(name in doc for name in recipes), (function.__name__, [n for n in recipes if n not in doc])

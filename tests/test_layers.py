"""The core package imports nothing beyond torch and the standard library, and never the toolbox or
the framework integrations.

Checks: every import statement of the core's source (module level or inside a function); the
integrations (`fp8train/integrations/`) import only the core, the standard library, torch and their
own framework; and a training step in a fresh interpreter where every package that torch itself does
not require is hidden (as in an environment where `pip install fp8train` pulled only torch), in which
importing each integration raises an ImportError that names its extra.

The rules of the core's inside: nothing outside `amax/` imports past its face; the core's
import graph has no cycle; no import runs from a lower layer to a higher one (LAYERS, the file layout in
docs/design.md, section 10).
Imports are parsed, resolved and put in layers by scripts/architecture_metrics.py (which measures the
same graph for any tree); this file holds the rules.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

import fp8train

PACKAGE = pathlib.Path(fp8train.__file__).parent
REPO = PACKAGE.parent.parent


def _load_metrics():
    """scripts/architecture_metrics.py, loaded from its file (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "architecture_metrics", REPO / "scripts" / "architecture_metrics.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


METRICS = _load_metrics()
# The core's layers, lowest first, as design.md's file layout (section 10) lists them: (name, files or
# folders of fp8train).
# A module may import its own layer and those before it. Declared once, in the script, which measures
# the same table on trees from before the move.
LAYERS = METRICS.LAYERS
TREE = METRICS.Tree(REPO)
AMAX = PACKAGE / "amax"
RUNTIME = PACKAGE / "runtime"
TOOLS = PACKAGE / "tools"
INTEGRATIONS = PACKAGE / "integrations"
# each integration module and the distributions it may import besides the core, torch and the stdlib
FRAMEWORKS = {
    "__init__.py": set(),
    "hf.py": {"transformers", "safetensors"},
    "fp8_checkpoint.py": {"transformers", "safetensors", "accelerate"},
    "peft_fp8.py": {"peft"},
    "lightning.py": {"lightning"},
    "torchtitan.py": {"torchtitan"},
}


def _core_files() -> list[pathlib.Path]:
    # __main__.py is the `python -m fp8train` entry of the command (the toolbox), never imported
    return [
        p
        for p in PACKAGE.rglob("*.py")
        if TOOLS not in p.parents and INTEGRATIONS not in p.parents and p.name != "__main__.py"
    ]


def _imports(path: pathlib.Path, source: str = "") -> list[str]:
    """Absolute module names imported by `path` (relative imports resolved against its package)."""
    return [imp.written for imp in TREE.imports(path, source)]


KERNELS = PACKAGE / "numerics" / "kernels"


def test_core_imports_only_torch_and_the_standard_library() -> None:
    """The one exception: the fused GPU kernels' modules import triton (and torch_internals.py, inside
    the function that reads triton's one private name), which their face (kernels/__init__.py) imports
    only where a kernel runs (Triton is not a runtime dependency)."""
    files = _core_files()
    assert len(files) > 20, files  # the walk found the core
    offenders = []
    for path in files:
        allowed = {"fp8train", "torch", "__future__"} | set(sys.stdlib_module_names)
        if (KERNELS in path.parents and path.name != "__init__.py") or path.name == "torch_internals.py":
            allowed.add("triton")
        for name in _imports(path):
            top = name.split(".")[0]
            outside = name.startswith(("fp8train.tools", "fp8train.integrations"))
            if outside or top not in allowed:
                offenders.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert not offenders, "the core imports beyond torch or into the toolbox:\n" + "\n".join(offenders)


def test_integrations_import_the_core_and_their_framework_only() -> None:
    """Their framework is imported through `require` (a string), so the check covers both forms."""
    files = sorted(INTEGRATIONS.glob("*.py"))
    assert {p.name for p in files} == set(FRAMEWORKS), "an integration module without an entry in FRAMEWORKS"
    offenders = []
    for path in files:
        source = path.read_text(encoding="utf-8")
        required = {m.split(".")[0] for m in re.findall(r'require\(\s*"([\w.]+)"', source)}
        allowed = {"fp8train", "torch", "__future__"} | set(sys.stdlib_module_names) | FRAMEWORKS[path.name]
        for name in _imports(path) + sorted(required):
            if name.startswith("fp8train.tools") or name.split(".")[0] not in allowed:
                offenders.append(f"integrations/{path.name}: {name}")
    assert not offenders, "an integration imports beyond its framework:\n" + "\n".join(offenders)


def test_the_import_check_resolves_relative_imports() -> None:
    """So a core file importing the toolbox relatively would be caught."""
    source = "from ..tools import demo\nfrom ..tools.report import render\nimport numpy\n"
    assert _imports(PACKAGE / "modules" / "linear.py", source) == [
        "fp8train.tools",
        "fp8train.tools.report",
        "numpy",
    ]
    assert _imports(PACKAGE / "autocast.py", "from . import tools\n") == ["fp8train.tools"]


# Runs in a fresh interpreter without site-packages: sys.path holds the standard library, a folder
# with links to torch and the distributions torch requires (nothing else), and fp8train's source.
_ONLY_TORCH = r"""
import sys
sys.path[:0] = sys.argv[1:3]
import torch
import fp8train as ft

torch.manual_seed(0)
model = torch.nn.Sequential(ft.LayerNormMLP(32, 64), ft.Linear(32, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    with ft.fp8_autocast(fp8_recipe=ft.DelayedScaling(amax_history_len=4)):
        loss = model(torch.randn(8, 32)).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
ft.synchronize()
import importlib.util
assert importlib.util.find_spec("matplotlib") is None and importlib.util.find_spec("numpy") is None
tools = [m for m in sys.modules if m.startswith("fp8train.tools")]
for name, extra in (("hf", "hf"), ("lightning", "lightning"), ("torchtitan", "torchtitan")):
    try:
        importlib.import_module("fp8train.integrations." + name)
    except ImportError as exc:
        assert f'pip install "fp8train[{extra}]"' in str(exc), str(exc)
    else:
        raise AssertionError(f"fp8train.integrations.{name} imported without its framework")
print("OK", float(loss), tools)
"""


def _torch_distributions() -> set[str]:
    """torch and the distributions it requires, transitively (extras aside), normalised names."""
    dists, todo = set(), ["torch"]
    while todo:
        name = todo.pop()
        if name in dists:
            continue
        dists.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" not in req:
                todo.append(_normalise(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]))
    return dists


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_a_training_step_needs_only_torch(tmp_path) -> None:
    import torch

    dists = _torch_distributions()
    modules = {
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if any(_normalise(owner) in dists for owner in owners)
    }
    assert "torch" in modules and not {"matplotlib", "tqdm", "numpy", "pytest"} & modules
    site = pathlib.Path(torch.__file__).parent.parent
    only_torch = tmp_path / "site-packages"
    only_torch.mkdir()
    for entry in site.iterdir():
        stem = entry.name.split(".")[0]
        is_metadata = entry.name.endswith(".dist-info") and _normalise(stem.split("-")[0]) in dists
        if stem in modules or is_metadata:
            (only_torch / entry.name).symlink_to(entry)
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _ONLY_TORCH, str(only_torch), str(PACKAGE.parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ok, loss, tools = result.stdout.split()
    assert ok == "OK" and float(loss) > 0
    assert tools == "[]", "the core imported the toolbox"


SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "runs", "build"}


def _repository_files() -> list[pathlib.Path]:
    files = []
    for path in REPO.rglob("*"):
        parts = set(path.relative_to(REPO).parts)
        if path.is_file() and not parts & SKIP_DIRS and not any(p.endswith(".egg-info") for p in parts):
            files.append(path.relative_to(REPO))
    return files


def test_the_file_layout_lists_every_file() -> None:
    """docs/design.md, section 10, "File layout" (the README links to it)."""
    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    start = design.index("File layout\n")
    layout = design[start : design.index("\n## ", start)]
    files = _repository_files()
    assert len(files) > 80 and pathlib.Path("src/fp8train/amax/state.py") in files
    missing = [str(f) for f in files if f.name not in layout]
    assert not missing, "docs/design.md's file layout does not list: " + ", ".join(sorted(missing))


# What `import fp8train` and the command's start-up must not import: the compiler stack (torch._dynamo
# and inductor, sympy, triton: about as long again as `import torch`), nor the toolbox's plotting.
HEAVY_AT_IMPORT = ("torch._dynamo", "torch._inductor", "sympy", "triton", "matplotlib")


HELP = "from fp8train.tools.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"


@pytest.mark.parametrize("code", ["import fp8train", HELP], ids=["import", "help"])
def test_import_fp8train_leaves_the_compiler_unimported(code) -> None:
    """Start-up (issue 39, item 7): `import fp8train` and `fp8train --help` cost about `import torch`;
    the compiler is imported where it is used (a traced FP8 call, prepare's first model). Times are
    measured by `fp8train bench startup`; this counts modules."""
    probe = f"import sys\n{code}\nprint(sorted(m for m in {HEAVY_AT_IMPORT!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{code!r} imported {out.stdout.strip()[-200:]}"


# nn.Module methods a subclass overrides and calls through super(), namedtuple's and the wrapper
# subclass's documented methods, aten ops named in a dispatch table: underscored, not private API
_EXTENSION_POINTS = {"_apply", "_save_to_state_dict", "_replace", "_make_wrapper_subclass", "_to_copy"}


def _private_reads(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each attribute `x._name` (or `getattr(x, "_name")`) that fp8train does not
    define itself, and each test of a class name against FSDP's."""
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
        ):
            if (
                len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name = node.args[1].value
        if name and name.startswith("_") and not name.startswith("__"):
            if name not in own and name not in _EXTENSION_POINTS:
                found.append((node.lineno, f".{name}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "startswith"
        ):
            if any(isinstance(a, ast.Constant) and a.value == "FSDP" for a in node.args):
                found.append((node.lineno, 'startswith("FSDP")'))
    return sorted(found)


def _own_names(trees: list[ast.AST]) -> set[str]:
    """Every underscored name the core defines: functions, classes, attributes it assigns, fields."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return {name for name in own if name.startswith("_")}


def test_private_torch_apis_go_through_torch_internals() -> None:
    """design.md, section 12: a private attribute of torch's (or DDP's, FSDP2's) objects is read only in
    torch_internals.py, where its function says what it relies on."""
    # torch_internals.py is left out of both: what it writes (FSDPParam._unsharded_inner_tensors) is torch's
    trees = {
        path: ast.parse(path.read_text(encoding="utf-8"))
        for path in _core_files()
        if path.name != "torch_internals.py"
    }
    own = _own_names(list(trees.values()))
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line}: {what}"
        for path, tree in trees.items()
        for line, what in _private_reads(tree, own)
    ]
    assert not offenders, "private torch APIs outside torch_internals.py:\n" + "\n".join(offenders)


def test_the_private_api_check_finds_reads() -> None:
    source = (
        "p._version\ngetattr(t, '_local_tensor', t)\nm._own\nm._own = 1\n"
        "type(m).__name__.startswith('FSDP')\nsuper()._apply(f)\ntype(m).__name__\n"
    )
    tree = ast.parse(source)
    found = _private_reads(tree, _own_names([tree]))
    assert found == [(1, "._version"), (2, "._local_tensor"), (5, 'startswith("FSDP")')]


def _face_names(folder: pathlib.Path = AMAX) -> set[str]:
    """What `folder`/__init__.py exports (`__all__`): its names, and the namespaces it makes part of
    the face (amax/: `roles`, the role layout; `views`, the readers fp8train.inspection names; ...)."""
    tree = ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{folder.name}/__init__.py has no __all__")


def _past_the_face(path: pathlib.Path, source: str = "", folder: pathlib.Path = AMAX) -> list[str]:
    face = {f"fp8train.{folder.name}.{name}" for name in _face_names(folder)}
    return [
        f"{imp.path}:{imp.line}: {imp.target}"
        for imp in TREE.imports(path, source)
        if imp.target.startswith(f"fp8train.{folder.name}.") and imp.target not in face
    ]


def test_nothing_outside_amax_imports_past_its_face() -> None:
    """Outside `amax/` (the core, tools, integrations, benchmarks, scripts, examples) code imports
    `fp8train.amax` only: `from .amax import ...`, `from .. import amax`, never `amax.<module>`. The
    tests may unit-test the protocol's internals, so tests/ is not checked."""
    files = [p for p in PACKAGE.rglob("*.py") if AMAX not in p.parents]
    files += [p for folder in ("benchmarks", "scripts", "examples") for p in (REPO / folder).rglob("*.py")]
    assert len(files) > 90 and (AMAX / "__init__.py").is_file()
    offenders = [line for path in files for line in _past_the_face(path)]
    assert not offenders, "imports past amax's face (export the name from amax/__init__.py):\n" + "\n".join(
        offenders
    )


def test_nothing_outside_the_runtime_imports_past_its_face() -> None:
    """The same rule for runtime/ (docs/design.md, section 3.1): amax/ included, it goes through
    `fp8train.runtime` only."""
    files = [p for p in PACKAGE.rglob("*.py") if RUNTIME not in p.parents]
    files += [p for folder in ("benchmarks", "scripts", "examples") for p in (REPO / folder).rglob("*.py")]
    offenders = [line for path in files for line in _past_the_face(path, folder=RUNTIME)]
    assert not offenders, "imports past the runtime's face:\n" + "\n".join(offenders)
    past = _past_the_face(PACKAGE / "amax" / "hooks.py", "from ..runtime.state import STATE\n", RUNTIME)
    assert [line.split(": ")[1] for line in past] == ["fp8train.runtime.state"]


def test_the_face_check_sees_every_form_of_import() -> None:
    """Relative and absolute, `from P import module`, under TYPE_CHECKING and inside functions; the
    face's own names (even one spelled like a module of amax/: `settings`) pass."""
    past = (
        "from .amax.state import REGISTRY\n"
        "from .amax import state\n"
        "import fp8train.amax.channel\n"
        "if TYPE_CHECKING:\n    from .amax.calls import Call\n"
        "def f():\n    from fp8train.amax.regions import enter_region\n"
    )
    found = [line.split(": ")[1] for line in _past_the_face(PACKAGE / "fsdp.py", past)]
    assert found == [
        "fp8train.amax.state",
        "fp8train.amax.state",
        "fp8train.amax.channel",
        "fp8train.amax.calls",
        "fp8train.amax.regions",
    ]
    flags = [(i.type_only, i.in_function) for i in TREE.imports(PACKAGE / "fsdp.py", past)]
    assert flags[3:] == [(True, False), (False, True)]
    face = "from .amax import settings, enter_region\nfrom . import amax\nimport fp8train.amax\n"
    assert not _past_the_face(PACKAGE / "fsdp.py", face)
    assert not _past_the_face(PACKAGE / "modules" / "base.py", "from .. import amax\n")


def test_the_core_has_no_import_cycle() -> None:
    """Counting imports under TYPE_CHECKING and inside functions: each one is a dependency a reader
    must follow, and a cycle means two modules that cannot be understood apart."""
    found = METRICS.cycles(TREE.graph())
    assert not found, "import cycles in the core:\n" + "\n".join(METRICS.cycle_text(*c) for c in found)


def test_the_cycle_check_finds_a_cycle_and_prints_it() -> None:
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"d"}}
    assert METRICS.cycles(graph) == [(["a", "b", "c"], ["a", "b", "c", "a"])]
    assert METRICS.cycles({"a": {"b"}, "b": set()}) == []


def test_every_core_module_is_in_exactly_one_layer() -> None:
    entries = [entry for _, layer in LAYERS for entry in layer]
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    assert not repeated, f"in more than one layer: {repeated}"
    paths = {e: PACKAGE.joinpath(*e.split(".")) for e in entries}  # "numerics.formats": numerics/formats
    stale = [e for e, p in paths.items() if not p.with_suffix(".py").is_file() and not p.is_dir()]
    assert not stale, f"LAYERS names what src/fp8train/ does not hold: {stale}"
    modules = TREE.core_modules()
    assert len(modules) > 50 and "fp8train.runtime.calls" in modules
    unplaced = []
    for module in modules:
        try:
            TREE.layer_of(module)
        except ValueError as err:
            unplaced.append(str(err))
    assert not unplaced, "\n".join(unplaced)
    placed = [
        LAYERS[TREE.layer_of(m)][0]
        for m in ("fp8train.recipe", "fp8train.runtime.calls", "fp8train.amax.hooks", "fp8train")
    ]
    assert placed == ["vocabulary", "runtime", "amax", "doors and readers"]
    # the longest entry places a module: numerics/ is the numerics layer but for formats.py
    dotted = ("fp8train.numerics.formats", "fp8train.numerics.cast", "fp8train.numerics.kernels.rounding")
    assert [LAYERS[TREE.layer_of(m)][0] for m in dotted] == ["vocabulary", "numerics", "numerics"]


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    """Within a layer any direction is fine; imports under TYPE_CHECKING and inside functions count."""
    upward = TREE.upward_imports()
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(
        map(TREE.arrow_text, upward)
    )


# what only a recipe with state knows: delayed scaling's flags, fields and state, by name
DELAYED_NAMES = {"per_step", "reduces_amax", "amax_group", "fp8_meta", "records_into", "amax_reduction"}


def _recipe_knowledge(source: str) -> list[str]:
    """Delayed scaling's names (attributes or names) and `Any` in `source`, each as "line: name"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = getattr(node, "attr", None) if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if name in DELAYED_NAMES or name == "Any":
            found.append((node.lineno, node.col_offset, name))
    return [f"{line}: {name}" for line, _, name in sorted(found)]


def test_the_runtime_knows_no_recipe() -> None:
    """runtime/ (regions, calls, plans, replays, handles, compiled ops) reaches a recipe's state through
    its hooks only (runtime/hooks.py; docs/design.md, section 3.1): no test of delayed scaling's flags
    (`per_step`, `reduces_amax`), none of its fields or state, no `Any` where a recipe is meant; and it
    imports neither amax/ nor quantization/ (the layers, above, say so too)."""
    offenders = {}
    for path in sorted(RUNTIME.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        found = _recipe_knowledge(source)
        found += [f"import {i.target}" for i in TREE.imports(path, source)
                  if i.target.startswith(("fp8train.amax", "fp8train.quantization"))]  # fmt: skip
        if found:
            offenders[path.name] = found
    assert not offenders, f"runtime/ knows a recipe: {offenders}"
    assert len(list(RUNTIME.glob("*.py"))) >= 5


def test_the_runtime_rule_sees_delayed_knowledge() -> None:
    source = "from typing import Any\nif q.reduces_amax and group.recipe.per_step:\n    x: Any = m.fp8_meta\n"
    assert _recipe_knowledge(source) == ["2: reduces_amax", "2: per_step", "3: Any", "3: fp8_meta"]


def test_the_layer_check_sees_an_upward_import() -> None:
    source = (
        "from .amax import enter_region\nif TYPE_CHECKING:\n    from .quantization.base import Quantization\n"
    )
    imports = TREE.imports(PACKAGE / "recipe.py", source)
    upward = [i.target for i in imports if TREE.layer_of(i.target) > TREE.layer_of(i.source)]
    assert upward == ["fp8train.amax", "fp8train.quantization.base"]


def test_one_way_into_the_gemm() -> None:
    """fp8_linear runs one path for every weight and input source (modules/sources.py picks them, once
    per call): its decision count (scripts/architecture_metrics.py, (f)) at most 19, half of the 38
    it had when its sources were branches of its own (74dd396)."""
    counts = METRICS.decision_counts(TREE)
    assert counts["modules/fp8_linear.py:fp8_linear"] <= 19, counts["modules/fp8_linear.py:fp8_linear"]
    assert counts["modules/sources.py:weight_source"] <= 19  # the one table of where a weight comes from


def test_the_decision_count_counts_every_branch() -> None:
    branches = (
        "def f(a, b):\n"
        "    if a and b or a:\n        pass\n    elif b:\n        pass\n"
        "    x = [i for i in a if i] if a else None\n"
        "    for _ in a:\n        while b:\n            pass\n"
        "    try:\n        pass\n    except ValueError:\n        pass\n"
        "    g = lambda: a or b\n"
    )
    assert METRICS.decision_count(ast.parse(branches).body[0]) == 1 + 3 + 1 + 2 + 2 + 1 + 1

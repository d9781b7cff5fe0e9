"""Architecture measures of one fp8train tree, to compare before and after a refactor (issue 28).

    python scripts/architecture_metrics.py [ROOT] [--python PY] [--out metrics.json] [--no-walk]

ROOT is a checkout of the repository (default: the one holding this script). Everything but the walk
is read from the source with `ast` (standard library only, any Python 3.9+). The walk runs the tree's
code and needs torch: `--python` names an interpreter that has it (default: this one).

What is measured:

(a) modules: the files directly in src/fp8train/ other than __init__.py and __main__.py, and the
    folders directly in it that are packages.
(b) arrows: the core is src/fp8train/ minus tools/ and integrations/. A node is a module; a package
    is its __init__.py. An arrow A -> B is a distinct pair of core modules, A != B, where A's source
    holds an import statement that binds B: `import B`, `from B import name`, or `from P import B`
    when B is a submodule that P/__init__.py does not bind a name for (so `from fp8train.amax import
    settings` reaches the face, which exports a `settings` object). Imports under `if TYPE_CHECKING:`
    and inside functions count; importing P.B is an arrow to P.B only (not also to P). Each module
    has the layer of LAYERS (below; design.md's file layout, top to bottom); an arrow runs from a lower layer
    to a higher one when its target's layer comes later in LAYERS than its source's. A tree without
    src/fp8train/amax/ is from before the move: its modules take the layer of their new home
    (FORMER_HOMES); so do the numerics of a tree without src/fp8train/numerics/ (NUMERICS_HOMES).
(c) cycles: the strongly connected components of (b)'s graph with more than one module, each with
    one shortest cycle through its first module.
(d) the walk: two gloo ranks (127.0.0.1) each train one `fp8train.Linear(32, 16)` with SGD under
    `fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4))`, eager, train mode; steps 1 and 2
    warm up (registration, first allocation) and step 3 is traced on rank 0 with `sys.setprofile`.
    Two walks: "forward", from the call of `Linear.forward` until the `with fp8_autocast` block has
    exited (its exit launches the amax all-reduce), and "backward", the call of `loss.backward()`
    (whose end launches the backward amaxes). Only Python frames whose code lies in the tree's
    src/fp8train/ are seen; torch and the standard library are transparent (a package function
    called by torch counts as called from the innermost package frame below it). A room is a module
    file; "per file" counts each file of amax/ as its room, "amax as one room" counts amax/ (and,
    before the move, the files that moved into it; after the split of issue 40, runtime/ too) as one,
    "amax and runtime as two rooms" each folder as one. The current room is the room of the
    innermost package frame (kept while no package frame is on the stack). Counted:
      rooms           the sequence of current rooms, consecutive repeats collapsed ("stays");
      distinct_rooms  how many different rooms the walk enters;
      room_changes    len(rooms) - 1: every change of the current room, by a call or a return;
      reentries       calls INTO a room other than the current one that the walk had already left
                      (it was the current room and the current room changed away from it); returns
                      up the stack to a caller are not counted;
      callbacks       those reentries whose room is still on the stack below (a call back up);
      entries         per room, the calls into it from another room (so for amax/ as one room:
                      how often the walk enters the protocol).
(e) the files a new recipe touches are not measurable here.
(f) decision counts: per function (methods and nested functions each on their own), 1 + its `if`s
    and `elif`s, conditional expressions, `for` and `while` loops, `except` clauses, comprehensions
    (each `for` of one), `match` cases, and the operands of each `and`/`or` beyond the first, counted
    anywhere in its body, lambdas and nested functions included (a McCabe-like count read with `ast`;
    it gives the figures of the review of 74dd396: fp8_linear 38, plan_forward 19, meta.load 19).
    Listed: the core's highest, and the toolbox's.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
from collections import deque
from typing import NamedTuple, Optional

# The core's layers, lowest first (docs/design.md, "File layout", top to bottom): a module may import
# its own layer and the layers before it. An entry is a file directly in src/fp8train/ (its stem), a
# subpackage (every module in it), or a dotted module of a subpackage, which the longest matching entry
# places (numerics/formats.py, FP8's vocabulary, lies below the rest of numerics/: recipe.py imports it).
# tests/test_layers.py enforces this table on the code.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "vocabulary",
        (
            "numerics.formats",
            "recipe",
            "errors",
            "torch_internals",
            "debug_switches",
            "shape_rule",
            "user_warnings",
        ),
    ),
    ("numerics", ("numerics", "saved", "second_order", "tensor_parallel")),
    ("runtime", ("runtime",)),
    ("amax", ("amax",)),
    ("quantization", ("quantization",)),
    ("modules and parallel wrappers", ("fsdp", "modules", "comm", "optim", "distributed")),
    (
        "doors and readers",
        (
            "autocast",
            "convert",
            "prepare",
            "pipeline",
            "expert_parallel",
            "recompute",
            "checkpoint_files",
            "inspection",
            "layer_coverage",
            "tensor_stats",
            "telemetry",
            "__init__",
            "__main__",
        ),
    ),
)

# Before the move into amax/ (commit 3ec515a): each old module (relative to fp8train) -> its new home.
FORMER_HOMES = {
    "scaling": "amax.storage",
    "registry": "amax.state",
    "ops": "amax.calls",
    "plans": "amax.plans",
    "inspection": "amax.views",
    "channel": "amax.channel",
    "header": "amax.header",
    "reduction": "amax.reduction",
    "regions": "amax.regions",
    "stats": "amax.stats",
    "steps": "amax.steps",
    "streams": "amax.streams",
    "modules.scaling_meta": "amax.meta",
}
# Before the move into numerics/ (and the renames of the block files): each old top-level module (or
# package) -> its new home.
NUMERICS_HOMES = {
    "formats": "numerics.formats",
    "cast": "numerics.cast",
    "microscaling": "numerics.microscaling",
    "operand": "numerics.operand",
    "gemm": "numerics.gemm",
    "gemm_output": "numerics.gemm_output",
    "block_gemm": "numerics.block_scaled_mm",
    "block_format": "quantization.stored_block_weights",
    "kernels": "numerics.kernels",
}

PACKAGE = "fp8train"
OUTSIDE_CORE = ("tools", "integrations")


class Import(NamedTuple):
    """One imported name of one import statement."""

    source: str  # the importing module
    path: str  # its file, relative to the repository root
    line: int
    written: str  # the module the statement names, relative imports resolved (`from M import n`: M)
    target: str  # the module it binds: M.n when n is a submodule that M's __init__ does not bind
    type_only: bool  # under `if TYPE_CHECKING:`
    in_function: bool


class Tree:
    """The sources of one checkout: modules, their imports, the core's graph and layers."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root.resolve()
        self.src = self.root / "src"
        self.package = self.src / PACKAGE
        if not (self.package / "__init__.py").is_file():
            raise SystemExit(f"{self.package}/__init__.py not found: pass a checkout of fp8train as ROOT")
        self.moved = not (self.package / "amax").is_dir()  # a tree from before the move
        self.numerics_moved = not (self.package / "numerics").is_dir()  # before the move into numerics/
        self._bound: dict[str, set[str]] = {}

    # ---- modules -------------------------------------------------------------------------------
    def module_of(self, path: pathlib.Path) -> str:
        parts = path.relative_to(self.src).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def file_of(self, module: str) -> Optional[pathlib.Path]:
        base = self.src.joinpath(*module.split("."))
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate
        return None

    def core_files(self) -> list[pathlib.Path]:
        outside = [self.package / name for name in OUTSIDE_CORE]
        return sorted(p for p in self.package.rglob("*.py") if not any(o in p.parents for o in outside))

    def core_modules(self) -> list[str]:
        return [self.module_of(p) for p in self.core_files()]

    # ---- imports -------------------------------------------------------------------------------
    def imports(self, path: pathlib.Path, source: str = "") -> list[Import]:
        """Every name imported by `path` (a file of the tree or beside it), in any block."""
        inside = self.src in path.parents
        module = self.module_of(path) if inside else path.stem
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        rel = str(path.relative_to(self.root)) if self.root in path.parents else str(path)
        found: list[Import] = []

        def visit(node: ast.AST, type_only: bool, in_function: bool) -> None:
            def add(written: str, target: str) -> None:
                found.append(Import(module, rel, node.lineno, written, target, type_only, in_function))

            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                for alias in node.names:
                    add(base if node.module else f"{base}.{alias.name}", self._target(base, alias.name))
            function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.body:
                    visit(child, True, function)
                for child in node.orelse:
                    visit(child, type_only, function)
                return
            for child in ast.iter_child_nodes(node):
                visit(child, type_only, function)

        visit(ast.parse(source or path.read_text(encoding="utf-8")), False, False)
        return list(dict.fromkeys(found))  # one per statement and target

    def _target(self, base: str, name: str) -> str:
        """What `from base import name` binds: the submodule base.name unless base's __init__ binds name."""
        init = self.file_of(base)
        if init is None or init.name != "__init__.py" or self.file_of(f"{base}.{name}") is None:
            return base
        if base not in self._bound:
            self._bound[base] = _bound_names(ast.parse(init.read_text(encoding="utf-8")))
        return base if name in self._bound[base] else f"{base}.{name}"

    # ---- the core's graph ----------------------------------------------------------------------
    def core_imports(self) -> list[Import]:
        """The imports of core modules whose target is another core module."""
        modules = set(self.core_modules())
        return [
            imp
            for path in self.core_files()
            for imp in self.imports(path)
            if imp.target in modules and imp.target != imp.source
        ]

    def graph(self) -> dict[str, set[str]]:
        arrows: dict[str, set[str]] = {m: set() for m in self.core_modules()}
        for imp in self.core_imports():
            arrows[imp.source].add(imp.target)
        return arrows

    def home(self, module: str) -> str:
        """The module's name relative to fp8train ("__init__" for the package), at its new home."""
        rel = "__init__" if module == PACKAGE else module.removeprefix(PACKAGE + ".")
        if self.moved:
            rel = FORMER_HOMES.get(rel, rel)
        if self.numerics_moved:
            first, dot, inner = rel.partition(".")
            rel = NUMERICS_HOMES.get(first, first) + dot + inner
        return rel

    def layer_of(self, module: str) -> int:
        """The index in LAYERS of the module's layer; ValueError when no layer lists it."""
        home = self.home(module)
        matches = [
            (len(entry), index)
            for index, (_, entries) in enumerate(LAYERS)
            for entry in entries
            if home == entry or home.startswith(entry + ".")
        ]
        if not matches:
            entry = home.split(".")[0]
            raise ValueError(f"{module}: in no layer of LAYERS (add its file or folder, {entry!r}, to one)")
        return max(matches)[1]

    def upward_imports(self) -> list[Import]:
        """Imports from a lower layer to a higher one."""
        return [imp for imp in self.core_imports() if self.layer_of(imp.target) > self.layer_of(imp.source)]

    def arrow_text(self, imp: Import) -> str:
        layers = f"{LAYERS[self.layer_of(imp.source)][0]} -> {LAYERS[self.layer_of(imp.target)][0]}"
        kind = " (TYPE_CHECKING)" if imp.type_only else " (in a function)" if imp.in_function else ""
        return f"{imp.path}:{imp.line}: {imp.source} -> {imp.target}{kind} [{layers}]"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (also inside top-level if/try blocks)."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ImportFrom) and node.level == 1 and not node.module:
            names |= {a.asname for a in node.names if a.asname and a.asname != a.name}  # submodules
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


_BRANCHES = (
    ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.comprehension, ast.match_case,
)  # fmt: skip


def decision_count(function: ast.AST) -> int:
    """(f)'s count of one function's definition."""
    count = 1
    for node in ast.walk(function):
        if isinstance(node, _BRANCHES):
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
    return count


def decision_counts(tree: Tree) -> dict[str, int]:
    """Every function of src/fp8train by its decision count, highest first: "path:qualified name"
    (the path relative to src/fp8train; `Class.method`, `outer.inner`) -> count."""
    counts: dict[str, int] = {}

    def visit(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                counts[f"{rel}:{prefix}{child.name}"] = decision_count(child)
                visit(child, rel, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, rel, f"{prefix}{child.name}.")
            else:
                visit(child, rel, prefix)

    for path in sorted(tree.package.rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), path.relative_to(tree.package).as_posix(), "")
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected component with more than one module (sorted), with one shortest cycle
    through its first module: [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return [(c, _shortest_cycle(graph, c)) for c in sorted(components)]


def _shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle in the component {component}")


# ---- the walk -----------------------------------------------------------------------------------
_WALK = r"""
import json, os, sys
src, rank, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.path.insert(0, src)
import torch
import torch.distributed as dist
import fp8train as ft
package = os.path.dirname(os.path.abspath(ft.__file__)) + os.sep
assert package.startswith(os.path.abspath(src)), (ft.__file__, src)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=2)
torch.manual_seed(0)
model = ft.Linear(32, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
recipe = ft.DelayedScaling(amax_history_len=4)
events = []

def profile(frame, event, arg):
    if event == "call" or event == "return":
        path = frame.f_code.co_filename
        if path.startswith(package):
            code = frame.f_code
            name = getattr(code, "co_qualname", code.co_name)
            events.append((event, path[len(package):].replace(os.sep, "/"), name))

walks = {}
for step in range(3):
    traced = rank == 0 and step == 2
    x = torch.randn(8, 32, requires_grad=True)
    with ft.fp8_autocast(fp8_recipe=recipe):
        if traced:
            sys.setprofile(profile)
        y = model(x)
    sys.setprofile(None)
    walks["forward"], events = events, []
    loss = y.float().square().mean()
    if traced:
        sys.setprofile(profile)
    loss.backward()
    sys.setprofile(None)
    walks["backward"], events = events, []
    opt.step()
    opt.zero_grad()
ft.synchronize()
dist.destroy_process_group()
if rank == 0:
    with open(out, "w") as f:
        json.dump(walks, f)
"""


def trace_walk(tree: Tree, python: str, out_dir: pathlib.Path) -> dict[str, list]:
    """The raw profile events of the traced step on rank 0: {"forward": [...], "backward": [...]}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = out_dir / "walk_events.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree.src)}
    ranks = [
        subprocess.Popen([python, "-c", _WALK, str(tree.src), str(rank), port, str(out)], env=env)
        for rank in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=600) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    if codes != [0, 0]:
        raise SystemExit(f"the walk's ranks exited with {codes}")
    return json.loads(out.read_text())


def walk_measures(events: list, room_of) -> dict:
    """(d)'s counts for one walk; `room_of(file)` names the room of a file of the package."""
    stack: list[str] = []
    current: Optional[str] = None
    left: set[str] = set()
    rooms: list[str] = []  # "room: how the walk entered it"
    reentries: list[str] = []
    entries: dict[str, int] = {}
    callbacks = 0
    for kind, file, function in events:
        if kind == "call":
            room = room_of(file)
            if room != current:
                entries[room] = entries.get(room, 0) + 1
                if room in left:
                    reentries.append(f"{room}: {function}")
                    callbacks += room in stack
            stack.append(room)
            how = function
        elif stack:
            stack.pop()
            how = "(return)"
        new = stack[-1] if stack else current
        if new != current:
            if current is not None:
                left.add(current)
            rooms.append(f"{new}: {how}")
            current = new
    names = [r.split(": ")[0] for r in rooms]
    return {
        "distinct_rooms": len(set(names)),
        "room_changes": max(len(rooms) - 1, 0),
        "reentries": len(reentries),
        "callbacks": callbacks,
        "entries": dict(sorted(entries.items(), key=lambda e: -e[1])),
        "rooms": rooms,
        "reentered": reentries,
    }


def walks(tree: Tree, events: dict[str, list]) -> dict:
    def per_file(file: str) -> str:
        return file

    def amax_as_one(file: str) -> str:
        module = tree.module_of(tree.package / file)
        return "amax/" if tree.home(module).split(".")[0] in ("amax", "runtime") else file

    def folders(file: str) -> str:
        module = tree.module_of(tree.package / file)
        top = tree.home(module).split(".")[0]
        return f"{top}/" if top in ("amax", "runtime") else file

    return {
        walk: {
            "per file": walk_measures(ev, per_file),
            "amax as one room": walk_measures(ev, amax_as_one),
            "amax and runtime as two rooms": walk_measures(ev, folders),
        }
        for walk, ev in events.items()
    }


# ---- the report ---------------------------------------------------------------------------------
def measure(tree: Tree, python: Optional[str], scratch: pathlib.Path) -> dict:
    top = tree.package
    files = sorted(p.name for p in top.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    folders = sorted(p.name for p in top.iterdir() if (p / "__init__.py").is_file())
    graph = tree.graph()
    pairs = {(a, b) for a, targets in graph.items() for b in targets}
    runtime = {(i.source, i.target) for i in tree.core_imports() if not i.type_only}
    upward = tree.upward_imports()
    result = {
        "root": str(tree.root),
        "before_the_move": tree.moved,
        "top_level_modules": len(files),
        "top_level_folders": len(folders),
        "folders": folders,
        "core_modules": len(graph),
        "arrows": len(pairs),
        "runtime_arrows": len(runtime),
        "upward_arrows": len({(i.source, i.target) for i in upward}),
        "upward_imports": [tree.arrow_text(i) for i in upward],
        "cycles": [cycle_text(*c) for c in cycles(graph)],
        "runtime_cycles": [cycle_text(*c) for c in cycles(_graph_of(graph, runtime))],
        "decision_counts": decision_counts(tree),
    }
    if python:
        result["walk"] = walks(tree, trace_walk(tree, python, scratch))
    return result


def cycle_text(component: list[str], cycle: list[str]) -> str:
    """One of `cycles()`'s results, to print."""
    names = ", ".join(m.removeprefix(PACKAGE + ".") for m in component)
    return f"{len(component)} modules ({names}), e.g. {' -> '.join(cycle)}"


def _graph_of(graph: dict[str, set[str]], pairs: set[tuple[str, str]]) -> dict[str, set[str]]:
    return {m: {b for a, b in pairs if a == m} for m in graph}


def render(result: dict) -> str:
    lines = [
        f"tree: {result['root']}" + ("  (before the move into amax/)" if result["before_the_move"] else "")
    ]
    lines.append(
        f"(a) top-level modules: {result['top_level_modules']}; folders: {result['top_level_folders']} "
        f"({', '.join(result['folders'])})"
    )
    lines.append(
        f"(b) core: {result['core_modules']} modules, {result['arrows']} arrows "
        f"({result['runtime_arrows']} outside TYPE_CHECKING), {result['upward_arrows']} from a lower layer "
        f"to a higher one, in {len(result['upward_imports'])} imports:"
    )
    lines += [f"      {a}" for a in result["upward_imports"]]
    lines.append(
        f"(c) cycles (TYPE_CHECKING counted), as strongly connected components: {len(result['cycles'])}"
    )
    lines += [f"      {c}" for c in result["cycles"]]
    lines.append(f"    cycles outside TYPE_CHECKING: {len(result['runtime_cycles'])}")
    lines += [f"      {c}" for c in result["runtime_cycles"]]
    outside = tuple(f"{name}/" for name in OUTSIDE_CORE)
    for part, in_core in (("core", True), ("tools and integrations", False)):
        top = [f"{k} {n}" for k, n in result["decision_counts"].items() if k.startswith(outside) != in_core]
        lines.append(f"(f) decision counts, {part}, highest: " + ", ".join(top[:5]))
    for walk, scales in result.get("walk", {}).items():
        for scale, m in scales.items():
            lines.append(
                f"(d) {walk}, {scale}: {m['distinct_rooms']} rooms, {len(m['rooms'])} stays, "
                f"{m['room_changes']} changes, {m['reentries']} returns to a room already left "
                f"({m['callbacks']} of them calls back up); entries: "
                + ", ".join(f"{room} {n}" for room, n in m["entries"].items())
            )
            lines.append("      " + " > ".join(m["rooms"]))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?", default=str(pathlib.Path(__file__).resolve().parent.parent))
    parser.add_argument("--python", default=sys.executable, help="an interpreter with torch, for the walk")
    parser.add_argument("--no-walk", action="store_true", help="leave out (d), which runs the tree's code")
    parser.add_argument("--out", default=None, help="also save the measures as JSON here")
    args = parser.parse_args(argv)
    tree = Tree(pathlib.Path(args.root))
    with tempfile.TemporaryDirectory() as scratch:
        result = measure(tree, None if args.no_walk else args.python, pathlib.Path(scratch))
    print(render(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

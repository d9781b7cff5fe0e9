"""The API reference: HTML pages generated from the docstrings of fp8train's public modules, by pdoc.

    python -m fp8train.tools.api_reference --out DIR      # DIR/index.html, one page per module

Why pdoc (docs/api.md): one pip package (`pdoc`, in the `test` and `docs` extras) and no
configuration; it imports the modules and reads `__all__`, signatures and docstrings, so the reference
is the code's own account, and its Python API renders a module in a second, which lets the test
suite build the whole reference (tests/tools/test_api_reference.py). Sphinx autodoc and mkdocstrings
need a configured project (conf.py or mkdocs.yml, a theme, a build directory) for the same pages.

`check_docstrings` is the rule the test enforces: every public name of every public module has a
docstring, and every parameter of a public function, class (its constructor) or public method is
named in its docstring.
"""

from __future__ import annotations

import argparse
import html
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional

__all__ = ["PUBLIC_MODULES", "INTEGRATIONS", "public_names", "check_docstrings", "build", "main"]

# the modules whose public names (their __all__) the reference documents and the test checks
PUBLIC_MODULES = (
    "fp8train",
    "fp8train.comm",
    "fp8train.optim",
    "fp8train.inspection",
    "fp8train.telemetry",
    "fp8train.pipeline",
    "fp8train.debug_switches",
    "fp8train.integrations",
)
# framework integrations: each imports its framework (an optional extra), so each is documented
# where its framework is installed
INTEGRATIONS = (
    "fp8train.integrations.hf",
    "fp8train.integrations.lightning",
    "fp8train.integrations.peft_fp8",
    "fp8train.integrations.torchtitan",
    "fp8train.integrations.fp8_checkpoint",
)
# a page of its own, its members not checked: the protocol's face inside the package (docs/design.md,
# section 3), public for its knobs (`fp8train.amax.settings`)
PAGE_ONLY = ("fp8train.amax",)

# parameters a docstring need not name: the instance, the class, and torch.nn.Module.forward's
# conventional input where the docstring says what the module computes of it
_IMPLICIT = {"self", "cls"}


def public_names(module) -> list[tuple[str, object]]:
    """(name, object) for each name in `module.__all__`, submodules left out (they have pages)."""
    return [
        (name, getattr(module, name))
        for name in module.__all__
        if not inspect.ismodule(getattr(module, name))
    ]


def _own_methods(cls: type) -> Iterable[tuple[str, Callable]]:
    """The public methods and properties `cls` defines itself (not those of torch or object)."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            yield name, value


def _parameters(obj) -> list[str]:
    """The named parameters of a function, or of a class's constructor."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    if isinstance(obj, property) or target is object.__init__:
        return []
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in signature.parameters.values()
        if p.name not in _IMPLICIT and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _docstring(obj) -> str:
    """What the reference shows for `obj`: its docstring, and for a class its constructor's too, and
    where fp8train's class inherits its constructor from another of fp8train's, that class's (which
    describes the parameters)."""
    parts = [inspect.getdoc(obj) or ""]
    if inspect.isclass(obj):
        owner = next((c for c in obj.__mro__ if "__init__" in vars(c)), object)
        if vars(owner)["__init__"].__doc__:
            parts.append(inspect.getdoc(vars(owner)["__init__"]) or "")
        if owner is not obj and owner.__module__.startswith("fp8train."):
            parts.append(inspect.getdoc(owner) or "")
    return "\n".join(parts)


def _mentions(doc: str, parameter: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(parameter)}(?!\w)", doc) is not None


def _check_one(where: str, obj, problems: list[str]) -> None:
    doc = _docstring(obj)
    if not doc.strip():
        problems.append(f"{where}: no docstring")
        return
    missing = [p for p in _parameters(obj) if not _mentions(doc, p)]
    if missing:
        problems.append(f"{where}: parameters not named in its docstring: {', '.join(missing)}")


def check_docstrings(module_names: Iterable[str]) -> list[str]:
    """Every problem of the public names of `module_names`: a module, name or public method without a
    docstring, or a parameter its docstring does not name. [] when the reference is complete."""
    problems: list[str] = []
    for module_name in module_names:
        module = importlib.import_module(module_name)
        if not (module.__doc__ or "").strip():
            problems.append(f"{module_name}: no module docstring")
        if not hasattr(module, "__all__"):
            problems.append(f"{module_name}: no __all__ (the reference documents the names it lists)")
            continue
        for name, obj in public_names(module):
            where = f"{module_name}.{name}"
            if not (inspect.isclass(obj) or callable(obj)):
                continue  # a constant: its page entry is its value
            _check_one(where, obj, problems)
            if inspect.isclass(obj):
                for method_name, method in _own_methods(obj):
                    _check_one(f"{where}.{method_name}", method, problems)
    return problems


def available_integrations() -> list[str]:
    """The integration modules whose framework is installed here (each imports its own)."""
    found = []
    for name in INTEGRATIONS:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        found.append(name)
    return found


def build(out: Path, modules: Optional[Iterable[str]] = None) -> list[Path]:
    """Write the reference's HTML pages (pdoc) under `out`, one per module of `modules` (default: the
    public modules, the amax page and the integrations whose framework is installed), and
    `out/index.html`. Returns the pages written. Offline: pdoc reads the imported modules only.

    Raises ImportError (naming the extra) when pdoc is not installed."""
    try:
        import pdoc.doc
        import pdoc.render
    except ImportError as exc:
        raise ImportError(
            'the API reference is built by pdoc, which is not installed: pip install "fp8train[docs]"'
        ) from exc
    names = list(modules) if modules is not None else [*PUBLIC_MODULES, *PAGE_ONLY, *available_integrations()]
    docs = {name: pdoc.doc.Module(importlib.import_module(name)) for name in names}
    pdoc.render.configure(docformat="google", search=False, show_source=False)
    out = Path(out)
    pages = []
    for name, doc in docs.items():
        page = out / (name.replace(".", "/") + ".html")
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(pdoc.render.html_module(doc, all_modules=docs), encoding="utf-8")
        pages.append(page)
    index = out / "index.html"
    index.write_text(_index_page(docs), encoding="utf-8")
    return [index, *pages]


def _index_page(docs: dict) -> str:
    """index.html: every module's page, with the first line of its docstring."""
    rows = "\n".join(
        f'<li><a href="{name.replace(".", "/")}.html">{name}</a>: '
        f"{html.escape((doc.docstring.strip().splitlines() or [''])[0])}</li>"
        for name, doc in docs.items()
    )
    return (
        '<!doctype html>\n<html lang="en">\n<head><meta charset="utf-8"><title>fp8train API reference</title>'
        f"</head>\n<body>\n<h1>fp8train API reference</h1>\n<ul>\n{rows}\n</ul>\n</body>\n</html>\n"
    )


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m fp8train.tools.api_reference --out DIR [--check]`: build the reference into DIR;
    `--check` also lists docstring problems (`check_docstrings`) and exits 1 if there are any."""
    parser = argparse.ArgumentParser(
        prog="python -m fp8train.tools.api_reference",
        description="Build fp8train's API reference (HTML, by pdoc) from its docstrings.",
    )
    parser.add_argument("--out", required=True, type=Path, help="the directory to write the pages into")
    parser.add_argument(
        "--check", action="store_true", help="also check that every parameter of a public name is documented"
    )
    args = parser.parse_args(argv)
    pages = build(args.out)
    print(f"wrote {len(pages)} pages: open {pages[0]}")
    if args.check:
        problems = check_docstrings([*PUBLIC_MODULES, *available_integrations()])
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

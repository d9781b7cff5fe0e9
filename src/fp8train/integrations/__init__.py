"""Framework integrations, outside the core: each module imports its framework, which is an optional
extra (`pip install "fp8train[hf]"`, `[lightning]`, `[torchtitan]`). The core never imports them."""

from __future__ import annotations

import importlib

__all__ = ["require"]


def require(module: str, extra: str, what: str):
    """Import `module` (returned) or raise an ImportError that names the `extra` to install and `what`
    needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f'{what} needs {module.split(".")[0]}, which is not installed: pip install "fp8train[{extra}]"'
        ) from exc

"""Warnings to the user: attributed to the user's line, and renamed arguments.

`warn_user`: a fixed `stacklevel` is right for one call path only (`prepare` calls `convert_to_fp8`, a
module's forward is reached through torch.nn.Module's call machinery), so the level is counted at
run time: the first caller outside fp8train and torch.

`renamed_argument`: one naming scheme (docs/guide.md, "Names"): TransformerEngine's names where
TransformerEngine has the function (`fp8_autocast(fp8_recipe=, fp8_group=)`, `autocast(recipe=,
amax_reduction_group=)`), and one name everywhere else: `recipe`, `amax_reduction_group`, and
`module_filter_fn` (torchao's name in its `convert_to_float8_training`) for the callable that keeps
layers in high precision, which `prepare`, `integrations.hf.from_pretrained` and
`integrations.lightning.FP8Precision` called `filter_fn`. The old name still works, with a
DeprecationWarning.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

import torch

__all__ = ["warn_user", "UNSET", "renamed_argument"]

_SKIPPED = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (os.path.dirname(__file__) + os.sep + "__init__.py", torch.__file__)
)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` attributed to the first frame outside fp8train and torch."""
    level, frame = 1, inspect.currentframe().f_back
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


class _Unset:
    """The default of a deprecated argument: told apart from an explicit None."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def renamed_argument(new_value: Any, old_value: Any, new: str, old: str, where: str) -> Any:
    """The value of argument `new` of `where`, also given under its deprecated name `old`.

    `old_value` is UNSET unless the caller passed `old`: then it is the value, with a DeprecationWarning
    (pointing at the user's line). Passing both names raises a TypeError, as Python does for an
    argument given twice."""
    if old_value is UNSET:
        return new_value
    if new_value is not None:
        raise TypeError(
            f"{where} got both {new}= and {old}= (its deprecated name for the same argument): pass {new} only"
        )
    warn_user(
        f"{where}: {old}= is deprecated, pass {new}= (the same argument; one name across fp8train)",
        DeprecationWarning,
    )
    return old_value

"""What an amax reduction raises. Every rank of the group raises the same error (docs/design.md,
section 4)."""

from __future__ import annotations

__all__ = ["LayoutMismatchError", "StateMismatchError", "AmaxReductionError"]


class LayoutMismatchError(RuntimeError):
    """Ranks of an amax group contributed different FP8 roles or steps; no scale was updated."""


class StateMismatchError(LayoutMismatchError):
    """Ranks of an amax group agree on the layout but hold different FP8 scales (e.g. a load on one rank)."""


class AmaxReductionError(RuntimeError):
    """An amax all-reduce failed or timed out (a rank died or stalled); no scale was updated from it."""

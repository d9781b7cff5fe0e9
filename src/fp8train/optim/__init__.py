"""Optimizers that hold their state in fewer bytes (docs/guide.md, "Saving memory")."""

from .adamw import AdamW, bytes_per_parameter, state_bytes

__all__ = ["AdamW", "state_bytes", "bytes_per_parameter"]

"""The FP8 runtime of every recipe (docs/design.md, section 3)."""

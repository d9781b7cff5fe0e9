"""Checkpoint *files* that survive a dying job and fail loudly when damaged. (Not to be confused
with `fp8train.checkpoint`, which is activation recomputation, TransformerEngine's name.)

`torch.save` writes in place, so a rank killed while saving leaves a truncated file where its last
good checkpoint was; and `torch.load` reports a damaged file as whatever its zip reader or unpickler
tripped on (`OSError: Invalid argument`, `EOFError`, "negative seek value", ...). `save_checkpoint`
writes a temporary file and renames it over the old one (atomic on POSIX), and `load_checkpoint`
turns a read failure into one `CheckpointError` that names the file and the problem.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Union

import torch

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint"]

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(RuntimeError):
    """A checkpoint file could not be read: truncated, corrupted, or not a torch.save checkpoint."""


def save_checkpoint(obj: Any, path: PathLike) -> None:
    """torch.save `obj` to the file `path` atomically: readers see the old file or the complete new
    one. (A file; `fp8train.checkpoint` is activation recomputation.)"""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _complete_archive(path: str) -> bool:
    """Whether the file ends with a zip end record, as a complete torch.save archive does."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - 22))
        return f.read(4) == b"PK\x05\x06"


def _diagnose(path: str) -> str:
    size = os.path.getsize(path)
    if size == 0:
        return "the file is empty"
    if not _complete_archive(path):
        return (
            f"the file ({size} bytes) is not a complete torch.save archive: it was truncated (e.g. the "
            "job died while writing it), corrupted, or written by something else"
        )
    return "the archive is readable but its content is damaged or is not a plain tensor checkpoint"


def load_checkpoint(path: PathLike, map_location: Any = None, weights_only: bool = True) -> Any:
    """torch.load `path` (`weights_only=True` by default, as torch.load: tensors and plain containers
    only), with `map_location` as torch.load's (where tensors go: a device, a dict or a callable).

    Returns:
        The loaded object.

    Raises:
        CheckpointError: a damaged, truncated or foreign file, or Python objects under
            `weights_only=True` (the message names the problem and the fix).
        FileNotFoundError, IsADirectoryError, PermissionError: as torch.load.
    """
    path = os.fspath(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as exc:  # torch reports damage through many exception types
        first_line = (str(exc).strip().splitlines() or [""])[0]
        if weights_only and "Weights only load failed" in str(exc) and _complete_archive(path):
            raise CheckpointError(
                f"cannot load checkpoint {path!r} with weights_only=True: it holds Python objects "
                "other than tensors and plain containers. If you trust the file, call "
                "load_checkpoint(path, weights_only=False)"
            ) from exc
        raise CheckpointError(
            f"cannot load checkpoint {path!r}: {_diagnose(path)}. Use an earlier checkpoint. "
            f"(torch.load: {type(exc).__name__}: {first_line})"
        ) from exc

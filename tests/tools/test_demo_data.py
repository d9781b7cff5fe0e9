"""The demo's data: real text from the standard library (deterministic, offline) and the Markov language."""

from __future__ import annotations

import argparse
import math
import os
import sysconfig

import torch

from fp8train.tools.data import MarkovTask, stdlib_text, text_batches
from fp8train.tools.demo_worker import _dataset


def test_stdlib_text_is_the_sorted_source_files_as_bytes() -> None:
    text = stdlib_text(max_bytes=100_000)
    root = sysconfig.get_paths()["stdlib"]
    first = sorted(n for n in os.listdir(root) if n.endswith(".py"))[0]
    with open(os.path.join(root, first), "rb") as f:
        head = f.read(1000)
    assert len(text) == 100_000 and text.dtype == torch.long
    assert bytes(text[: len(head)].to(torch.uint8).tolist()) == head
    # real text: a few bytes dominate (space, e, newline), many are rare
    counts = torch.bincount(text, minlength=256).double()
    top = counts.sort(descending=True).values
    assert top[0] > 10 * top[40] > 0


def test_text_batches_are_windows_of_the_text_and_depend_on_the_seed() -> None:
    text = torch.arange(1000)
    a = text_batches(text, steps=3, batch=4, seq_len=16, seed=1)
    assert a.shape == (3, 4, 17)
    assert torch.equal(a[..., 1:] - a[..., :-1], torch.ones(3, 4, 16, dtype=torch.long))  # contiguous
    assert torch.equal(a, text_batches(text, 3, 4, 16, seed=1))
    assert not torch.equal(a, text_batches(text, 3, 4, 16, seed=2))


def _args(data: str) -> argparse.Namespace:
    return argparse.Namespace(model_size="tiny", steps=3, batch_size=2, seed=0, data=data)


def test_demo_dataset_text_uses_bytes_and_ranks_see_different_windows() -> None:
    cfg, data0, floor, source = _dataset(_args("text"), rank=0)
    _, data1, _, _ = _dataset(_args("text"), rank=1)
    assert cfg.vocab_size == 256 and floor is None and "standard library" in source
    assert data0.shape == (3, 2, cfg.seq_len + 1) and int(data0.max()) < 256
    assert not torch.equal(data0, data1)


def test_demo_dataset_markov_has_its_entropy_as_floor() -> None:
    cfg, data, floor, source = _dataset(_args("markov"), rank=0)
    assert cfg.vocab_size == 64 and "Markov" in source
    assert 0 < floor < math.log(4)  # at most 4 successors per token
    task = MarkovTask(cfg.vocab_size, cfg.seq_len, seed=0)
    pairs = data.reshape(-1, cfg.seq_len + 1)
    assert bool((task.probs[pairs[:, :-1], pairs[:, 1:]] > 0).all())  # every transition is possible

"""Checkpoint files: a truncated, garbage or damaged file, Python objects, a failed save and a foreign
checkpoint are each a clear error, and the previous checkpoint survives a failed save."""

from __future__ import annotations

import argparse
import io
import pickle

import pytest
import torch

import fp8train
from fp8train import CheckpointError, DelayedScaling, load_checkpoint, save_checkpoint
from fp8train.amax import decode_extra_state
from helpers import fp8_mlp, rank_batch, train_step

RECIPE = DelayedScaling(amax_history_len=4)


@pytest.fixture
def saved_checkpoint(tmp_path):
    model = fp8_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        train_step(model, opt, rank_batch(0, step), RECIPE)
    path = tmp_path / "good.pt"
    save_checkpoint({"model": model.state_dict()}, path)
    return path, model


@pytest.mark.parametrize("cut", [0, 0.01, 0.3, 0.9, 0.999])
def test_truncated_checkpoint_is_a_checkpoint_error(saved_checkpoint, tmp_path, cut: float) -> None:
    """torch.load alone reports these as OSError 'Invalid argument', EOFError or a miniz error."""
    good, _ = saved_checkpoint
    data = good.read_bytes()
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CheckpointError, match="truncated.pt.*(empty|truncated)"):
        load_checkpoint(bad)


def test_garbage_file_is_a_checkpoint_error(tmp_path) -> None:
    bad = tmp_path / "garbage.pt"
    bad.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(CheckpointError, match="not a complete torch.save archive"):
        load_checkpoint(bad)


def test_python_objects_need_weights_only_false_and_say_so(tmp_path) -> None:
    path = tmp_path / "with_args.pt"
    save_checkpoint({"args": argparse.Namespace(lr=0.1), "w": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match="weights_only=False") as error:
        load_checkpoint(path)
    assert "damaged" not in str(error.value)
    assert load_checkpoint(path, weights_only=False)["args"].lr == 0.1


def test_failed_save_keeps_the_previous_checkpoint(saved_checkpoint) -> None:
    path, _ = saved_checkpoint
    before = path.read_bytes()
    with pytest.raises((pickle.PicklingError, AttributeError)):
        save_checkpoint({"model": lambda: None}, path)  # cannot be pickled: fails half-way
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name], "temporary file left behind"


def _damaged(extra_state: bytes, key: str, value: float) -> bytes:
    """A module's extra state with the first forward `key` value replaced, as a damaged file gives it.

    The state is serialized bytes inside the checkpoint (pickled as text), so the damage is made on
    the decoded tensors rather than by flipping bytes of the file."""
    state = decode_extra_state(extra_state)
    state["scaling_fwd"][key].view(-1)[0] = value
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "key,value",
    [
        ("scale", -1.0),  # a flipped sign bit
        ("scale", 0.0),
        ("scale", float("inf")),
        ("scale_inv", float("nan")),
        ("amax_history", float("nan")),
        ("amax_history", -3.0),
    ],
)
def test_damaged_fp8_state_is_refused(saved_checkpoint, key: str, value: float) -> None:
    """torch.save has no checksum, so damaged values load; the FP8 state refuses impossible ones."""
    good, _ = saved_checkpoint
    state = load_checkpoint(good)["model"]
    state["0._extra_state"] = _damaged(state["0._extra_state"], key, value)
    with pytest.raises(ValueError, match=f"scaling_fwd: checkpoint {key}.*corrupted"):
        fp8_mlp(seed=5).load_state_dict(state)


def test_foreign_checkpoints_are_refused_by_name(saved_checkpoint) -> None:
    _, model = saved_checkpoint
    good = model.state_dict()
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    with pytest.raises(RuntimeError, match='Missing key.*"0._extra_state"'):
        fp8_mlp().load_state_dict(plain.state_dict())
    mlp = torch.nn.Sequential(fp8train.LayerNormMLP(16, 32), torch.nn.GELU(), fp8train.Linear(16, 16))
    with pytest.raises((ValueError, RuntimeError), match="different model|Missing key"):
        fp8_mlp().load_state_dict(mlp.state_dict())
    for extra, message in [
        (b"extra state of another library", "not an fp8train"),
        ({"version": 2, "scaling_fwd": {}}, "not an fp8train"),
        ({"version": 1, "scaling_fwd": {"scale": [1.0]}, "scaling_bwd": {}}, "not fp8train's"),
        (
            {
                "version": 1,
                "scaling_fwd": decode_extra_state(good["2._extra_state"])["scaling_bwd"],
                "scaling_bwd": {},
            },
            "different model",
        ),
    ]:
        state = dict(good)
        state["0._extra_state"] = extra
        with pytest.raises(ValueError, match=message):
            fp8_mlp().load_state_dict(state)

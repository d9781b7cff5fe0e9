"""A CPU dry run of the GPU check (scripts/gpu_check.sh): every section runs and writes its JSON.

On a GPU the same script asserts the torch._scaled_mm path, compares CUDA with the CPU emulation,
runs steady steps under torch.cuda.set_sync_debug_mode("error") and times FP8 against bf16; here the
sections run at tiny sizes with host timers, which is what can go wrong before a GPU is lent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("paths", "emulation", "syncs", "speed", "idle")


def test_gpu_check_dry_run_on_cpu(tmp_path) -> None:
    env = dict(
        os.environ,
        GPU_RESULTS=str(tmp_path),
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
    )
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for section in SECTIONS:
        with open(tmp_path / f"{section}.json") as f:
            result = json.load(f)
        assert result["ok"] is True and result["section"] == section and result["device"] == "cpu"
    with open(tmp_path / "syncs.json") as f:
        syncs = json.load(f)
    assert syncs["async"]["launched"] > 0 and syncs["blocking"]["sync_error"] is None
    with open(tmp_path / "speed.json") as f:
        assert len(json.load(f)["rows"]) == 3  # Linear, LayerNormMLP (one size each here), launch-bound

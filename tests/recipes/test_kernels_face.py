"""The face of the fused kernels (fp8train.numerics.kernels) keeps Python's attribute protocol where
triton is missing: its per-tensor casts are looked up on first use (a module `__getattr__`, PEP 562),
and a lookup that cannot succeed raises AttributeError (naming the fix), so `hasattr` and
`getattr(..., default)` answer instead of raising ImportError. Runs in a fresh process with triton
hidden (sys.modules['triton'] = None), whether or not triton is installed here."""

from __future__ import annotations

import os
import subprocess
import sys


def test_probing_the_per_tensor_casts_without_triton_answers_and_imports_nothing() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import pytest\n"
        "from fp8train.numerics import kernels\n"
        "assert not hasattr(kernels, 'cast_with_amax')\n"
        "assert getattr(kernels, 'amax_then_cast', None) is None\n"
        "with pytest.raises(AttributeError, match='triton'):\n"
        "    kernels.cast_with_amax\n"
        "assert not hasattr(kernels, 'no_such_kernel')\n"
        "assert 'fp8train.numerics.kernels.triton_cast' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]

"""fp8train: FP8 training for PyTorch under TransformerEngine's recipes (delayed, current and block
scaling), with delayed scaling's global amax reduction asynchronous by default and correct by
construction."""

from . import amax, comm, debug_switches, inspection, pipeline, telemetry
from .autocast import autocast, fp8_autocast
from .checkpoint_files import CheckpointError, load_checkpoint, save_checkpoint
from .convert import convert_to_fp8
from .distributed import broadcast_fp8_state
from .errors import AmaxReductionError, LayoutMismatchError, StateMismatchError
from .expert_parallel import ExpertParallel
from .inspection import reduction_stats, reset_reduction_stats, synchronize
from .layer_coverage import coverage
from .modules import (
    BlockFP8Linear,
    ExpertsLinear,
    FP8Module,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
    StoredFP8Experts,
    StoredFP8Linear,
    grouped_linear,
    pad_groups,
    unpad_groups,
)
from .prepare import first_and_last_linear_filter, is_prepared, prepare
from .quantization import register_recipe
from .recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from .recompute import checkpoint
from .tensor_parallel import reduce_sequence_parallel_grads

__version__ = "0.1.0"

end_step, end_step_on = amax.steps.end_step, amax.steps.end_step_on  # the step boundary (amax/steps.py)

__all__ = [
    "amax",
    "comm",
    "inspection",
    "pipeline",
    "telemetry",
    "debug_switches",
    "coverage",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Format",
    "fp8_autocast",
    "autocast",
    "synchronize",
    "reduction_stats",
    "reset_reduction_stats",
    "FP8Module",
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "LayerNorm",
    "RMSNorm",
    "StoredFP8Linear",
    "StoredFP8Experts",
    "BlockFP8Linear",
    "GroupedLinear",
    "ExpertsLinear",
    "grouped_linear",
    "pad_groups",
    "unpad_groups",
    "LayoutMismatchError",
    "StateMismatchError",
    "AmaxReductionError",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint",
    "end_step",
    "end_step_on",
    "convert_to_fp8",
    "prepare",
    "is_prepared",
    "first_and_last_linear_filter",
    "broadcast_fp8_state",
    "reduce_sequence_parallel_grads",
    "register_recipe",
    "ExpertParallel",
]

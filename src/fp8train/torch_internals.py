"""Every use of torch's private API and of DDP/FSDP2 internals, in one place (docs/design.md, section 12).

Each function says what fp8train needs it for and what it relies on. All of them were checked on
torch 2.13.0 (the tested version) and on the lowest supported torch (pyproject.toml; docs/design.md
says how). When a torch upgrade breaks fp8train, this is the file to read first.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

__all__ = [
    "graph_task_id",
    "current_graph_task",
    "in_backward",
    "at_end_of_backward",
    "register_ordered_effects",
    "keep_out_of_cuda_graphs",
    "round_divisions_as_eager",
    "round_precision_casts_as_eager",
    "triton_max_combine",
    "dispatch_mode_active",
    "scaled_mm",
    "has_scaled_mm",
    "scaled_mm_problem",
    "cuda_capability",
    "device_index",
    "SCALED_MM_KERNELS",
    "scaled_grouped_mm",
    "grouped_mm",
    "scaled_grouped_mm_problem",
    "unsafe_view",
    "tree_leaves",
    "tree_map_only",
    "inside_reentrant_checkpoint",
    "ddp_join_that_does_not_throw",
    "fsdp_param_of_caller",
    "pipeline_group_of_caller",
    "in_pipeline_shape_inference",
    "ddp_ignore",
    "version_counter",
    "dtensor_local",
    "children_by_name",
    "managed_by_fsdp2",
    "foreach_copy",
    "constant_for_compile",
    "DirectlyCalled",
    "PLAIN_TENSOR_TYPES",
]


# ---- torch.compile ---------------------------------------------------------------------------------
def constant_for_compile(fn: Callable) -> Callable:
    """`torch.compiler.assume_constant_result` without importing `torch._dynamo` (private: its mark).

    Traced code reads `fn`'s answer as a constant. torch's decorator imports `torch._dynamo` (about half
    of `import torch`'s time again) only to set the attribute dynamo's tracer looks for
    (`torch/_dynamo/decorators.py`, unchanged from 2.7 to 2.13; tests/test_layers.py checks it), so
    `import fp8train` sets it itself and leaves dynamo unimported until something compiles."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
"""Tensors whose memory is their own: a tensor subclass (FSDP2's gathered weight, a DTensor) may be a
wrapper without storage of its own, which a compiled kernel called directly would read as memory."""


class DirectlyCalled:
    """`fn` compiled by torch.compile (inductor, dynamic shapes, fullgraph, inductor `options`), whose
    compiled graph is then called directly, without dynamo: eager calls of fp8train's small compiled
    kernels (cast.py, gemm_output.py) would pay dynamo's frame evaluation, guards and AOTAutograd's
    runtime wrapper (about 50 us a call on a 2-core AMD EPYC, where the kernel of a 16K-element cast
    takes a few us) on every call.

    The first call goes through dynamo, which traces and compiles `fn` (inductor's on-disk caches
    shared by every process) through this object's backend; the backend keeps inductor's compiled
    graph and how to make its inputs from `fn`'s arguments: dynamo lifts each tensor argument and each
    dynamic size to a graph input, and says which in the placeholders' `grapharg.source` (private:
    `LocalSource` for an argument, `TensorPropertySource(SIZE)` for a size). Later calls whose tensors
    match the traced ones (plain tensors, `PLAIN_TENSOR_TYPES`; dtype, dimensions, the sizes dynamo
    did not make dynamic, at least 2 where it did: it specializes sizes 0 and 1; a graph with a size
    so specialized in a tensor whose other sizes are dynamic is not kept, the next one compiled is;
    contiguous, as the traced ones must have been for the graph to be kept) call the graph with
    those inputs (`_direct_call`: checks written for the one graph, and inductor's
    `current_callable`). The direct check is the layout check: inductor's own per-input size and
    stride asserts are compiled out (`size_asserts`; about 1 us each, 3-4 per kernel, where the
    check's `is_contiguous` is a tenth of that), and what dynamo's guards would check beyond the
    layout the callers fix by their variant key (cast.py). A direct call that raises falls back to
    the dynamo call for good. Anything unexpected in the graph (another kind of input, outputs that
    are not `fn`'s flat tuple of tensors) leaves the dynamo call in charge: the same values, slower.

    `fn` computes no gradients (its graph is an inference graph). It takes tensors (then arguments
    with defaults, constants of the graph) and returns a flat tuple of tensors (no None: the graph
    drops them), or writes into a tensor argument (`x.copy_(...)`) and returns (): AOTAutograd keeps
    an inference graph's input mutations in the graph, where inductor writes them itself (a pointwise
    update of the input's own buffer, read and written by the same loop), so the direct call does
    them too. It does not bump the mutated tensor's version counter (AOTAutograd's wrapper would):
    write only into tensors autograd has not recorded (gemm_output.py: the fresh product of a GEMM).
    A direct call that raises is made again through dynamo: sound for such a function because a
    pointwise kernel does not raise midway (no integer division: its only check after the loop).
    Floats `fn` reads from Python are specialized (dynamo would lift them to inputs);
    sizes are not duck-shaped (dynamo would assume sizes that were equal in the first call equal).
    Checked on torch 2.13 (tests/recipes/test_small_casts.py counts that the direct call runs)."""

    def __init__(self, fn: Callable, options: dict) -> None:
        self.fn = fn
        # (size_asserts off: the direct call checks the layout itself; dynamo's calls are guarded)
        self.options = {**options, "size_asserts": False}
        # the direct call, once traced and usable: a function of `fn`'s tensors that calls inductor's
        # compiled graph where they fit it, else `traced` (`_direct_call`)
        self.graph: Optional[Callable] = None
        # what callers call (hot paths: `kernel.call(...)`, one frame fewer than `kernel(...)`): `traced`,
        # then the direct call once a graph is kept
        self.call: Callable = self.traced
        self.direct_calls = 0  # calls that took the graph directly (tests count them)
        self._inputs: tuple = ()  # per graph input: (argument index, dimension or -1), once kept
        self._compiled = torch.compile(fn, backend=self._backend, dynamic=True, fullgraph=True)

    def __call__(self, *args: torch.Tensor):
        return self.call(*args)

    def after_error(self, *args: torch.Tensor):
        """A direct call raised: dynamo's call from now on."""
        self.graph, self.call = None, self.traced
        return self.traced(*args)

    def traced(self, *args: torch.Tensor):
        """The call through dynamo (its first traces and compiles `fn`)."""
        with _tracing_settings():
            # (tensors without grad: one graph whatever the caller's, which the graph ignores)
            return self._compiled(*[a.detach() if a.requires_grad else a for a in args])

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._functorch import config as functorch_config
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        inner: list = []  # inductor's compiled graphs (AOTAutograd's inference graph: one)

        def inner_compile(graph_module: torch.fx.GraphModule, inputs: list, **kwargs):
            compiled = compile_fx_inner(graph_module, inputs, **kwargs)
            inner.append((graph_module, compiled))
            return compiled

        # AOTAutograd's cache off: on a hit it would skip `inner_compile` (inductor's own cache serves)
        with contextlib.ExitStack() as settings:
            if hasattr(functorch_config, "enable_autograd_cache"):
                settings.enter_context(functorch_config.patch(enable_autograd_cache=False))
            graph = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=self.options)
        # (the layout of the tensors this graph was traced with, not of the last call that began
        # tracing: another thread's call may have begun meanwhile)
        contiguous = all(t.is_contiguous() for t in example_inputs if isinstance(t, torch.Tensor))
        if self.graph is None and not self._inputs and contiguous:
            try:
                self._keep(gm, graph, inner)
            except Exception:  # (private API another torch changed): dynamo's calls stay in charge
                self._inputs = ()
        return graph

    def _keep(self, gm: torch.fx.GraphModule, graph: Callable, inner: list) -> None:
        """Keep inductor's graph for direct calls, with how to call it, where `gm` fits."""
        code, defaults = self.fn.__code__, self.fn.__defaults__ or ()
        plan = _graph_inputs(gm, code.co_varnames[: code.co_argcount - len(defaults)])
        # a tensor with sizes of both kinds (a 0 or 1 dynamo specialized in a dynamic tensor): its
        # static ones are not checked per call, so not this graph: the next compiled one
        if plan is not None and all(None not in s or set(s) == {None} for _, s in plan[1]):
            inputs, tensors, equal = plan
            checks = tuple(
                (i, dtype, len(sizes), None if None in sizes else torch.Size(sizes),
                 tuple(d for d, n in enumerate(sizes) if n is None))
                for i, (dtype, sizes) in enumerate(tensors)
            )  # fmt: skip
            direct, boxed = _innermost(graph, gm, inner)
            self._inputs = inputs
            # (last: a call from another thread may take it now)
            self.call = _direct_call(self, direct, boxed, checks, equal, inputs)
            self.graph = self.call


def _direct_call(owner: DirectlyCalled, graph: Callable, boxed: bool, checks: tuple, equal: tuple,
                 inputs: tuple) -> Callable:  # fmt: skip
    """For `DirectlyCalled`: a function of the traced function's tensors that checks them against the
    graph (`checks`: per argument, its index, dtype, dimensions, static sizes or None, dynamic
    dimensions; each tensor of a dimension or more contiguous; `equal`: sizes the trace proved
    equal) and calls `graph` with its inputs (`inputs`), else `owner.traced` (and where the graph
    raises, `owner.after_error`); it counts `owner.direct_calls`. Its source is
    written for the one graph, straight-line (each tensor's shape read once, no loops): about 1 us
    for three tensors where the loops over `checks` took 5.

    Where `graph` is inductor's compiled graph (`boxed`), it calls the graph's `current_callable`
    (private: the generated module's `call`, which `CompiledFxGraph.__call__` calls between a
    profiler label, an autotune-cache bundler's end, which the first call, dynamo's, did, and runtime
    metrics) unless the profiler is on (then the graph, for its label); a torch whose graph is
    another class, or has no `current_callable`, gets the graph called as it is."""
    params = [f"a{i}" for i in range(len(checks))]
    conds, sizes, bound = [], [], {"P": PLAIN_TENSOR_TYPES, "graph": graph, "owner": owner}
    for i, dtype, ndim, static, dynamic in checks:
        bound[f"d{i}"] = dtype
        conds += [f"a{i}.__class__ in P", f"a{i}.dtype is d{i}", f"a{i}.ndim == {ndim}"]
        if ndim:  # (the traced tensors were: `DirectlyCalled._backend`)
            conds.append(f"a{i}.is_contiguous()")
        if static is not None and ndim:
            bound[f"z{i}"] = static
            conds.append(f"a{i}.shape == z{i}")
        sizes += [f"s{i}[{d}] > 1" for d in dynamic]
    sizes += [f"s{i}[{d}] == s{j}[{e}]" for i, d, j, e in equal]
    shaped = sorted({i for i, d in inputs if d >= 0} | {i for i, *_ in equal} | {j for *_, j, _ in equal})
    args = ", ".join(f"a{i}" if d < 0 else f"s{i}[{d}]" for i, d in inputs)
    call = f"graph({args})"
    if boxed:
        call = f"graph([{args}])"
        try:
            from torch._inductor.output_code import CompiledFxGraph

            if (
                type(graph).__call__ is CompiledFxGraph.__call__
                and callable(getattr(graph, "current_callable", None))
                and hasattr(torch.autograd.profiler, "_is_profiler_enabled")
            ):
                bound["profiler"] = torch.autograd.profiler
                call = f"graph.current_callable([{args}]) if not profiler._is_profiler_enabled else {call}"
        except ImportError:
            pass
    names = ", ".join(params)
    lines = [f"def direct({names}):", f"    if {' and '.join(conds) or 'True'}:"]
    lines += [f"        s{i} = a{i}.shape" for i in shaped]
    indent = "        "
    if sizes:
        lines.append(f"        if {' and '.join(sizes)}:")
        indent += "    "
    lines += [
        f"{indent}try:",
        f"{indent}    out = {call}",
        f"{indent}except Exception:",
        f"{indent}    return owner.after_error({names})",
        f"{indent}owner.direct_calls += 1",
        f"{indent}return out",
    ]
    lines.append(f"    return owner.traced({names})")
    code = compile("\n".join(lines) + "\n", f"{__file__}:<direct call of {owner.fn.__name__}>", "exec")
    exec(code, bound)
    return bound["direct"]


def _innermost(graph: Callable, gm: torch.fx.GraphModule, inner: list) -> tuple[Callable, bool]:
    """(Inductor's compiled graph itself, True: a `CompiledFxGraph`, called with a list of its inputs), where
    AOTAutograd's inference graph takes dynamo's inputs and returns its outputs one for one (no
    aliases, mutations left outside the graph or extra outputs for its runtime wrapper to handle: then
    that wrapper and dynamo's `disable` around it only cost time, but for the version counter of an
    input mutated in the graph), else (`graph`, the function dynamo calls, False)."""

    def counts(module: torch.fx.GraphModule) -> tuple[int, int]:
        nodes = list(module.graph.nodes)
        outputs = nodes[-1].args[0] if nodes and nodes[-1].op == "output" else None
        n_out = len(outputs) if isinstance(outputs, (tuple, list)) else -1
        return sum(n.op == "placeholder" for n in nodes), n_out

    if len(inner) != 1 or counts(inner[0][0]) != counts(gm) or not callable(inner[0][1]):
        return graph, False
    return inner[0][1], True


def _tracing_settings() -> contextlib.ExitStack:
    """For `DirectlyCalled`'s dynamo calls: floats as constants (`specialize_float`), and no size
    assumed equal to another that was equal in the first call (`use_duck_shape`): the graph's inputs
    are then the function's tensors and their sizes, each free. Where a torch lacks a setting, the
    graph may not fit `_graph_inputs`: dynamo's calls then stay in charge."""
    from torch._dynamo import config
    from torch.fx.experimental import _config as shapes

    settings = contextlib.ExitStack()
    if hasattr(config, "specialize_float"):
        settings.enter_context(config.patch(specialize_float=True))
    if hasattr(shapes, "use_duck_shape"):
        settings.enter_context(shapes.patch(use_duck_shape=False))
    return settings


def _graph_inputs(gm: torch.fx.GraphModule, names: tuple) -> Optional[tuple[tuple, tuple, tuple]]:
    """For `DirectlyCalled`: per input of dynamo's graph `gm`, (argument index, dimension or -1);
    per argument of the traced function (`names`), its (dtype, static sizes or None); and the
    dynamic sizes that are no input of their own because the trace proved them equal to one that is
    (a bias's size and its output's columns), as (argument, dimension, the input's argument,
    dimension): checked equal at each call. None where the graph takes something else."""
    from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource

    inputs, values, tensors = [], {}, [None] * len(names)
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        value = node.meta.get("example_value")
        if isinstance(source, LocalSource) and source.local_name in names:
            if not isinstance(value, torch.Tensor):
                return None
            index = names.index(source.local_name)
            tensors[index] = value
            inputs.append((index, -1))
        elif (
            isinstance(source, TensorPropertySource)
            and source.prop == TensorProperty.SIZE
            and isinstance(source.base, LocalSource)
            and source.base.local_name in names
        ):
            inputs.append((names.index(source.base.local_name), source.idx))
            values[str(value)] = inputs[-1]
        else:
            return None
    if any(t is None for t in tensors):
        return None
    equal = []
    for i, t in enumerate(tensors):
        for d, n in enumerate(t.shape):
            if not isinstance(n, int) and (i, d) not in inputs:
                if str(n) not in values:
                    return None  # a size the graph computes from others: not ours
                equal.append((i, d, *values[str(n)]))
    shapes = tuple((t.dtype, tuple(n if isinstance(n, int) else None for n in t.shape)) for t in tensors)
    return tuple(inputs), shapes, tuple(equal)


# ---- autograd engine -------------------------------------------------------------------------------
def graph_task_id() -> int:
    """The running backward pass (autograd graph task), -1 outside one (`torch._C`).

    Names a backward pass: its amaxes are launched when it ends, and amaxes a pass left behind when
    it raised are told apart from the next pass's."""
    return torch._C._current_graph_task_id()


# `graph_task_id` itself, for the hot path (amax recording: one builtin call, no wrapper)
current_graph_task = torch._C._current_graph_task_id


def in_backward() -> bool:
    """Whether a backward pass is running: there, a forward call is an activation recomputation."""
    return current_graph_task() != -1


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` when the running backward pass ends (the engine's `queue_callback`): the one point
    every rank reaches after every collective DDP or FSDP2 issued during the pass."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def register_ordered_effects(ops: Iterable) -> bool:
    """Mark custom ops as ordered side effects (`torch._higher_order_ops.effects`), so compiled graphs
    neither drop nor reorder the protocol's ops. False where torch has no such registry."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:
        return False
    for op in ops:
        _register_effectful_op(op, _EffectType.ORDERED)
    return True


# ---- inductor (torch.compile's code generator) ----------------------------------------------------------
def keep_out_of_cuda_graphs(op_names: Iterable[str]) -> bool:
    """Have inductor split its graphs around these custom ops when it uses CUDA graphs
    (`config.custom_should_partition_ops`): with mode="reduce-overhead" the compute between them is
    captured and replayed, and they run, Python and all, at every call. An effectful op lowered on a
    CUDA tensor would otherwise be captured (inductor partitions around CPU ops and ops it knows, not
    around Python side effects) and skipped at replay. False where torch lacks the option."""
    from torch._inductor import config

    names = getattr(config, "custom_should_partition_ops", None)
    if names is None:
        return False
    config.custom_should_partition_ops = [*names, *(name for name in op_names if name not in names)]
    return True


def round_divisions_as_eager() -> bool:
    """Have inductor's GPU kernels round float32 divisions as eager kernels do
    (`config.eager_numerics.division_rounding`): Triton's `/` is an approximate division, so compiled
    scales (fp8_max / amax, 1 / scale) could differ from eager ones in the last bit. Process-wide, for
    every compiled graph; left as it is where TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING is set (the
    user's choice). Whether divisions are rounded as eager; False where torch lacks the option."""
    from torch._inductor import config

    numerics = getattr(config, "eager_numerics", None)
    if numerics is None or not hasattr(numerics, "division_rounding"):
        return False
    if "TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING" not in os.environ:
        numerics.division_rounding = True
    return bool(numerics.division_rounding)


def round_precision_casts_as_eager() -> bool:
    """Have inductor keep the roundings to bf16/fp16 that eager code makes between fused ops
    (`config.emulate_precision_casts`). By default inductor elides a downcast followed by an upcast
    inside one kernel: the emulated bf16 GEMM on a CPU without bf16 instructions (an fp32 GEMM whose
    output is rounded to bf16, gemm.py) would then hand its unrounded fp32 output to the next ops, and
    half a bf16 step moves a few percent of the next cast's elements across an FP8 rounding boundary.
    Process-wide, like `round_divisions_as_eager`; left as it is where
    TORCHINDUCTOR_EMULATE_PRECISION_CASTS is set (the user's choice). Whether casts are kept; False
    where torch lacks the option."""
    from torch._inductor import config

    if not hasattr(config, "emulate_precision_casts"):
        return False
    if "TORCHINDUCTOR_EMULATE_PRECISION_CASTS" not in os.environ:
        config.emulate_precision_casts = True
    return bool(config.emulate_precision_casts)


# dispatch_mode_active() -> bool: whether a TorchDispatchMode is active (`torch.utils._python_dispatch`):
# dynamo does not compile under one, so the compiled cast (cast.py) goes through its custom op there,
# where the mode sees it. torch's function itself (asked at every compiled cast: no wrapper call).
dispatch_mode_active = is_in_torch_dispatch_mode


# ---- ops --------------------------------------------------------------------------------------------
# The kernels of `torch._scaled_mm` fp8train uses, each named by its scaling: one fp32 scale per tensor;
# DeepSeek's 1x128 / 128x128 fp32 block scales (SM90, cuBLASLt >= 12.9); MXFP8's E8M0 scales per 32
# and NVFP4's E4M3 scales per 16 of packed E2M1 values, both in cuBLAS's swizzled layout (SM100+).
SCALED_MM_KERNELS = ("tensorwise", "block", "mxfp8", "nvfp4")

# The one registry of device facts, found once per device and never changed: ("capability", index) ->
# (major, minor); (device type, index, kernel) -> "" where torch._scaled_mm runs that kernel, else why not.
_DEVICE_FACTS: dict[tuple, Any] = {}


@constant_for_compile  # traced code reads the answer as a constant
def cuda_capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device `index`, asked once (it never changes in a process)."""
    key = ("capability", index)
    if key not in _DEVICE_FACTS:
        _DEVICE_FACTS[key] = tuple(torch.cuda.get_device_capability(index))
    return _DEVICE_FACTS[key]


def device_index(device: torch.device) -> int:
    """The index of `device` (a CUDA device without one is the current device; -1 for the CPU)."""
    if device.type != "cuda":
        return -1 if device.index is None else device.index
    return torch.cuda.current_device() if device.index is None else device.index


def _probe_operands(kernel: str, device: torch.device):
    """(mat1, mat2, scale_a, scale_b, out_dtype, expected) of one small `kernel` call: all values and
    scales 1, so the product is K everywhere whatever the scales' layout."""
    f32 = dict(dtype=torch.float32, device=device)
    if kernel == "block":  # 256: two tiles along each dimension, so no scale shape is ambiguous
        a = torch.ones(256, 256, dtype=torch.float8_e4m3fn, device=device)
        return a, a.t(), torch.ones(2, 256, **f32).t(), torch.ones(2, 2, **f32).t(), torch.bfloat16, 256.0
    if kernel == "mxfp8":
        a = torch.ones(128, 128, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.full((128 * 4,), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
        return a, a.t(), scale, scale, torch.bfloat16, 128.0
    if kernel == "nvfp4":  # 0x22: two E2M1 ones per byte
        a = torch.full((128, 64), 0x22, dtype=torch.uint8, device=device).view(torch.float4_e2m1fn_x2)
        scale = torch.ones(128 * 8, **f32).to(torch.float8_e4m3fn)
        return a, a.t(), scale, scale, torch.float32, 128.0
    raise ValueError(f"unknown torch._scaled_mm kernel {kernel!r}: one of {SCALED_MM_KERNELS}")


def _probe(kernel: str, device: torch.device) -> None:
    """Run `kernel` once on `device` and check its value; raises where it does not run or is wrong
    ("grouped": torch._scaled_grouped_mm's two forms with row-wise scales, "grouped_mxfp8": its MX form,
    `_grouped_probe`)."""
    if kernel in ("grouped", "grouped_mxfp8"):
        _grouped_probe(device, "mxfp8" if kernel == "grouped_mxfp8" else "tensorwise")
        return
    if kernel == "tensorwise":  # both dtype pairs fp8train uses, both output kinds
        one = torch.ones((), dtype=torch.float32, device=device)
        a = torch.ones(16, 16, dtype=torch.float8_e4m3fn, device=device)
        g = torch.ones(16, 16, dtype=torch.float8_e5m2, device=device)
        calls = [(a, a.t(), one, one, torch.bfloat16, 16.0), (g, a.t(), one, one, torch.float32, 16.0)]
    else:
        calls = [_probe_operands(kernel, device)]
    for mat1, mat2, scale_a, scale_b, out_dtype, expected in calls:  # the op itself: not counted by
        # code that wraps torch._scaled_mm to count the GEMMs of a step (the GPU check does)
        y = torch.ops.aten._scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype=out_dtype)
        if not bool((y.float() == expected).all()):  # a host read, once per device and kernel
            raise RuntimeError(
                f"torch._scaled_mm computed a wrong product ({y.flatten()[0].item()} for {expected})"
            )


@constant_for_compile  # traced code reads the answer as a constant
def scaled_mm_problem(device_type: str, index: int, kernel: str = "tensorwise") -> str:
    """Why `torch._scaled_mm` cannot run `kernel` on this device ("" when it can), found by one small
    call per device and kernel (a torch without the op, a CUDA build or GPU without FP8 GEMMs, ROCm's
    fnuz dtypes, a cuBLASLt without the kernel, torch's CPU kernel before 2.8 or beyond per-tensor
    scales). On a GPU a failed probe warns once: fp8train emulates that GEMM there instead."""
    key = (device_type, index, kernel)
    if key in _DEVICE_FACTS:
        return _DEVICE_FACTS[key]
    problem = ""
    if not hasattr(torch, "_scaled_mm"):
        problem = f"torch {torch.__version__} has no torch._scaled_mm"
    elif kernel == "mxfp8" and not hasattr(torch, "float8_e8m0fnu"):
        problem = f"torch {torch.__version__} has no float8_e8m0fnu (MX scales)"
    elif kernel == "nvfp4" and not hasattr(torch, "float4_e2m1fn_x2"):
        problem = f"torch {torch.__version__} has no float4_e2m1fn_x2 (packed FP4)"
    else:
        device = torch.device(device_type) if index < 0 else torch.device(device_type, index)
        try:
            _probe(kernel, device)
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            problem = f"torch._scaled_mm ({kernel}) failed on {device}: {first}"
    if problem and device_type != "cpu":
        warnings.warn(f"fp8train: {problem}; that FP8 GEMM is emulated on this device", stacklevel=2)
    _DEVICE_FACTS[key] = problem
    return problem


def has_scaled_mm(device, kernel: str = "tensorwise") -> bool:
    """Whether `torch._scaled_mm` runs `kernel` on `device` (a torch.device or its name), probed once
    per device (`scaled_mm_problem`)."""
    device = torch.device(device)
    return not scaled_mm_problem(device.type, device_index(device), kernel)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """The hardware FP8/FP4 GEMM (`torch._scaled_mm`, cuBLASLt): a row-major, b column-major, the
    scales' dtype, shape and layout naming the kernel (docs/design.md, section 12)."""
    return torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum
    )


# ---- grouped GEMMs (mixture-of-experts) -----------------------------------------------------------------
def _grouped_probe(device: torch.device, kernel: str = "tensorwise") -> None:
    """The forms fp8train calls, once each, all values and scales 1 (so every product is K): rows in
    groups times a stack of column-major expert weights (2d-3d: forward, dgrad), and, with row-wise fp32
    scales ("tensorwise"), the weight gradient's form, groups along the reduction (2d-2d). "mxfp8": the
    2d-3d form with E8M0 scales (byte 127: 1.0) in the per-group blocked layout (every byte 1.0, so the
    product is K whatever the layout)."""
    e4m3 = dict(dtype=torch.float8_e4m3fn, device=device)
    one = dict(dtype=torch.float32, device=device)
    if kernel == "mxfp8":  # K = 128: four E8M0 scales per row, two groups of 32 rows (each 128 in scales)
        offs = torch.tensor([32, 64], dtype=torch.int32, device=device)
        rows = torch.ones(64, 128, **e4m3)
        experts = torch.ones(2, 16, 128, **e4m3).transpose(-2, -1)
        e8m0 = dict(dtype=torch.uint8, device=device)
        scale_a = torch.full((2 * 128, 4), 127, **e8m0).view(torch.float8_e8m0fnu)
        scale_b = torch.full((2, 4 * 128), 127, **e8m0).view(torch.float8_e8m0fnu)
        calls, expected = [(rows, experts, scale_a, scale_b)], 128.0
    else:
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        rows = torch.ones(32, 16, **e4m3)
        experts = torch.ones(2, 16, 16, **e4m3).transpose(-2, -1)
        calls = [
            (rows, experts, torch.ones(32, **one), torch.ones(2, 16, **one)),
            (
                rows.t().contiguous(),
                rows.t().contiguous().t(),
                torch.ones(2 * 16, **one),
                torch.ones(2 * 16, **one),
            ),
        ]
        expected = 16.0
    for mat_a, mat_b, scale_a, scale_b in calls:  # the op itself: not counted by code that wraps it
        y = torch.ops.aten._scaled_grouped_mm(
            mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16
        )
        if not bool((y.float() == expected).all()):  # a host read, once per device
            raise RuntimeError(
                f"torch._scaled_grouped_mm computed a wrong product ({y.flatten()[0].item()} for {expected})"
            )


@constant_for_compile  # traced code reads the answer as a constant
def scaled_grouped_mm_problem(device_type: str, index: int, kernel: str = "tensorwise") -> str:
    """Why `torch._scaled_grouped_mm` (FP8 grouped GEMM, bf16 output; `kernel` "tensorwise": row-wise
    fp32 scales, "mxfp8": E8M0 scales per 32) cannot run on this device ("" when it can), found by one
    small call of each form per device and kernel and kept in the registry of device facts (as
    `scaled_mm_problem`). torch has no CPU kernel of it: on the CPU it runs only where a test registers
    one (tests/cuda_contract.py)."""
    name = "grouped" if kernel == "tensorwise" else f"grouped_{kernel}"
    key = (device_type, index, name)
    if key in _DEVICE_FACTS:
        return _DEVICE_FACTS[key]
    problem = ""
    if kernel == "mxfp8" and not hasattr(torch, "float8_e8m0fnu"):
        problem = f"torch {torch.__version__} has no float8_e8m0fnu (MX scales)"
    elif not hasattr(torch, "_scaled_grouped_mm"):
        problem = f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    else:
        device = torch.device(device_type) if index < 0 else torch.device(device_type, index)
        try:
            _probe(name, device)
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            problem = f"torch._scaled_grouped_mm failed on {device}: {first}"
    if problem and device_type != "cpu":
        warnings.warn(f"fp8train: {problem}; grouped FP8 GEMMs run one GEMM per group there", stacklevel=2)
    _DEVICE_FACTS[key] = problem
    return problem


def scaled_grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """The FP8 grouped GEMM (`torch._scaled_grouped_mm`, torch >= 2.8; CUTLASS on SM90, SM100): E4M3
    operands, `mat_a` row-major, `mat_b` column-major in its last two dimensions; `offs` the int32 end
    offsets of the groups along the jagged dimension (rows of a 2-D `mat_a` against a 3-D `mat_b`, or
    the reduction of two 2-D operands); fp32 scales per row of `mat_a` and per column of `mat_b` (2-D
    operands: one block per group), or E8M0 scales per 32 (MXFP8, SM100; 2-D x 3-D: each group's and
    each expert's in cuBLAS's blocked layout); bf16 output, no bias (docs/design.md, section 9.2)."""
    return torch._scaled_grouped_mm(
        mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum
    )


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The bf16 grouped GEMM (`torch._grouped_mm`, the op of torch.nn.functional.grouped_mm; SM80+,
    a loop of mm elsewhere): the high-precision reference the GPU check times grouped FP8 against."""
    return torch._grouped_mm(mat_a, mat_b, offs=offs)


def unsafe_view(tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A reshape (to `shape`, of `tensor`'s number of elements) whose result autograd does not treat as
    a view, what `aten._unsafe_view` makes: what an FP8 GEMM returns, so that in-place ops on it
    (torch.relu_, a TP all-reduce) work as on torch.nn.Linear's. For a plain contiguous tensor outside
    autograd, dispatch modes and tracing, made as a new tensor on its storage (`set_`, through torch's
    bindings' fast path): the op's overload, called from Python through the generic dispatch path,
    cost about 30 us an FP8 linear call in a training step (the tiny GPT's 3-D activations)."""
    if (
        tensor.__class__ in PLAIN_TENSOR_TYPES
        and not tensor.requires_grad
        and tensor.is_contiguous()
        and not dispatch_mode_active()
        and not torch.compiler.is_compiling()
    ):
        return tensor.new_empty(0).set_(tensor.untyped_storage(), tensor.storage_offset(), shape)
    return _UNSAFE_VIEW(tensor, shape)


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default  # (the overload: no lookup per call)


def tree_leaves(tree) -> list:
    """Tensors nested in a __torch_dispatch__ call's arguments (`torch.utils._pytree`)."""
    return torch.utils._pytree.tree_leaves(tree)


def tree_map_only(cls: type, fn: Callable, tree):
    return torch.utils._pytree.tree_map_only(cls, fn, tree)


def foreach_copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its destination in one multi-tensor kernel per device and dtype
    (`torch._foreach_copy_`, torch >= 2.2, the op torch.optim's foreach paths use): the FP8 optimizer
    writes a chunk's states back without one kernel per parameter."""
    torch._foreach_copy_(destinations, sources)


# ---- tensors and modules ---------------------------------------------------------------------------
def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place changes `tensor` has seen (`Tensor._version`, the counter autograd keeps to
    refuse stale saved tensors; every in-place op bumps it, an optimizer step's included): tells a
    per-step group that the optimizer stepped without `end_step()` (amax/steps.py)."""
    return tensor._version


def dtensor_local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor object a DTensor holds (`DTensor._local_tensor`), or `tensor` itself when it is
    not a DTensor. Not `to_local()`: that is an autograd op returning a new alias, and fsdp.plain_weight
    must find the very `FSDPFP8Weight` inside FSDP2's sharded parameter."""
    return getattr(tensor, "_local_tensor", tensor)


def children_by_name(module: torch.nn.Module) -> list[tuple[str, Optional[torch.nn.Module]]]:
    """Every child slot of `module` in order, a child held under two names listed under both and empty
    (None) slots included (`Module._modules`): `named_children()` yields a shared child once, so
    convert_to_fp8 would leave its second name pointing at the unconverted layer."""
    return list(module._modules.items())


def managed_by_fsdp2(module: torch.nn.Module) -> bool:
    """Whether FSDP2's `fully_shard` manages `module`: it swaps the module's class for a subclass of
    `FSDPModule` (named `FSDP<Class>`; public in torch >= 2.6). Such a module refills its gathered
    parameters between microbatches (so their version counters move without an optimizer step) and
    gathers its weights itself. `replicate()`'s modules (torch's private `replicate_with_fsdp`, whose
    `ReplicateModule` subclasses `FSDPModule`) gather nothing: not FSDP2's in this sense. Nothing can be
    FSDP2's before torch.distributed.fsdp is imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(module, fsdp.FSDPModule):
        return False
    replicate = sys.modules.get("torch.distributed._composable.replicate_with_fsdp")
    return not isinstance(module, getattr(replicate, "ReplicateModule", ()))


# ---- triton (the fused kernels' language; imported only where a kernel is used) --------------------------
def triton_max_combine():
    """Triton's own combine function of `tl.max` (`triton.language.standard._elementwise_max`), for
    `tl.reduce`: Triton's interpreter maps this one to a vectorised numpy reduction and reduces element
    by element with any other, and `tl.max` itself is decorated (compiled or interpreted) once, when
    triton is first imported, so an interpreted kernel could not call it in a process that imported
    triton before TRITON_INTERPRET was set (fp8train/numerics/kernels/)."""
    import triton.language as tl

    return tl.standard._elementwise_max


# ---- call stacks: whose code is calling ------------------------------------------------------------------
def _caller_frames(skip: int):
    frame = sys._getframe(skip + 1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def inside_reentrant_checkpoint() -> bool:
    """Whether torch.utils.checkpoint(use_reentrant=True) is running a forward below us (its forward is
    `CheckpointFunction.forward`, found on the call stack): it runs without grad and cannot be matched
    to its recomputation, so it is refused in FP8 training regions."""
    code = torch.utils.checkpoint.CheckpointFunction.forward.__code__
    return any(frame.f_code is code for frame in _caller_frames(1))


def ddp_join_that_does_not_throw() -> bool:
    """Whether a DistributedDataParallel forward below us runs inside `join()` without
    `throw_on_early_termination` (DDP's private `_join_config`, torch >= 2.0): a rank that ran out of
    data would shadow DDP's collectives but not the amax all-reduce."""
    ddp_forward = torch.nn.parallel.DistributedDataParallel.forward.__code__
    for frame in _caller_frames(1):
        if frame.f_code is ddp_forward:
            config = getattr(frame.f_locals.get("self"), "_join_config", None)
            return config is not None and config.enable and not config.throw_on_early_termination
    return False


def pipeline_group_of_caller() -> Optional[Any]:
    """The process group of the `torch.distributed.pipelining` stage whose forward is running below us
    (a `_PipelineStageBase` found on the call stack: its `group`, None for the world), or False when
    no stage is running. Lets a module check, alone, that its amax group stays inside its stage."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:
        return False
    for frame in _caller_frames(1):
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, _PipelineStageBase):
            return candidate.group
    return False


_PIPELINE_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


def in_pipeline_shape_inference() -> bool:
    """Whether a `torch.distributed.pipelining` stage is running its one-time metadata (shape)
    inference below us: a forward on uninitialised tensors (torch.empty) of the right shapes, with
    grad enabled. FP8 regions entered there must neither cast nor record (the garbage would poison the
    amax histories for a whole history window). Checked only once pipelining has been imported."""
    if "torch.distributed.pipelining" not in sys.modules:
        return False
    return any(frame.f_code.co_name in _PIPELINE_INFERENCE for frame in _caller_frames(1))


def fsdp_param_of_caller() -> Any:
    """The FSDP2 `FSDPParam` that called an extension point of a parameter's tensor (torch >= 2.6).

    FP8 all-gathers change the dtype and size of the gather buffers FSDP2 caches per parameter
    (`FSDPParam.all_gather_outputs`) and of the buffer it frees at reshard
    (`FSDPParam._unsharded_inner_tensors`): fsdp.py resets and sets them on the object found here."""
    for frame in _caller_frames(1):
        candidate = frame.f_locals.get("self")
        if type(candidate).__name__ == "FSDPParam" and hasattr(candidate, "all_gather_outputs"):
            return candidate
    raise RuntimeError(
        "fsdp_fp8_all_gather: FSDP2's extension points were called from outside an FSDPParam; this torch "
        f"({torch.__version__}) changed FSDP2's internals. Build the modules without fsdp_fp8_all_gather"
    )


def reset_fsdp_gather_buffers(fsdp_param: Optional[Any] = None) -> None:
    """Make FSDP2 allocate new all-gather buffers for the calling parameter (a precision change)."""
    (fsdp_param or fsdp_param_of_caller()).all_gather_outputs = []


def set_fsdp_unsharded_buffer(data: torch.Tensor) -> None:
    """Tell FSDP2 which buffer to free when the calling parameter is resharded."""
    fsdp_param_of_caller()._unsharded_inner_tensors = [data]


def ddp_ignore(module: torch.nn.Module, names: list[str]) -> None:
    """Make DistributedDataParallel(module) leave these parameters alone (neither broadcast at
    construction nor reduced): DDP's private `_set_params_and_buffers_to_ignore_for_model`, torch >=
    1.8. Stored FP8 weights need it: gloo cannot broadcast FP8 dtypes."""
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | set(names)
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, sorted(ignored)
    )

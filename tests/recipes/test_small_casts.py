"""Small operands on the lean eager path (issue 37, item 3; docs/design.md, section 6, "The lean eager
path"): casts and GEMM outputs from `cast.FUSED_MIN_ELEMENTS` (4096) elements run as one compiled
kernel called without dynamo (`torch_internals.DirectlyCalled`), with the eager kernels' bits; counted
as aten calls per cast and per GEMM (a dispatch-mode counter), not timed."""

from __future__ import annotations

import pytest
import torch
from test_cast_gemm import _cast_and_amax, _hard_values, _same_bits  # tests/recipes: pytest's rootdir import

from fp8train.numerics import cast, gemm, gemm_output
from fp8train.tools.bench import lean_path
from fp8train.tools.bench.common import StepCensus
from fp8train.torch_internals import DirectlyCalled


def _eager(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with the compiled kernels off (torch's eager kernels), the registry as
    it was after."""
    saved = cast.COMPILED_KERNELS.enabled
    cast.COMPILED_KERNELS.set_enabled(False)
    try:
        return fn(*args, **kwargs)
    finally:
        cast.COMPILED_KERNELS.set_enabled(saved)


def test_a_small_cast_is_one_aten_call() -> None:
    """A cast of 4096 elements with its amax: one call (the compiled kernel's op) where torch's eager
    kernels make 15 (aminmax, neg, maximum, copy_, detach, empty_like, mul, clamp_, view, bitwise_and,
    view, clamp_, add_, sub_, copysign_: measured at 13da088)."""
    x, scale, slot = torch.randn(64, 64) * 30, torch.tensor(2.0), torch.zeros(())
    cast.cast_with_amax(x, scale, "e4m3", torch.float32, transposed=False, amax_out=slot)  # compiles
    with StepCensus() as census:
        cast.cast_with_amax(x, scale, "e4m3", torch.float32, transposed=False, amax_out=slot)
    assert census.calls == 1 and census.ops["fused_cast"] == 1, census.ops
    with StepCensus() as eager:
        _eager(cast.cast_with_amax, x, scale, "e4m3", torch.float32, transposed=False, amax_out=slot)
    assert eager.calls >= 14, eager.ops  # what the compiled kernel replaces


def test_tiny_gpt_shapes_aten_calls_per_gemm() -> None:
    """Four MLP blocks at the tiny GPT's sizes (64-256-64, 256 tokens: operands of 4K-64K elements),
    FP8 delayed scaling, eager, fwd + bwd, 24 GEMMs: aten calls per FP8 GEMM beyond the fp32 step's
    (the step's own bookkeeping spread over them). At 13da088: 24.9 (casts under 64K elements and the
    GEMM outputs in torch's eager kernels), 10.9 after that; 5.96 at c9d0de3, now 4.6 (the casts MAX
    their amaxes into the recording slots themselves: no `maximum` per record)."""
    torch.set_num_threads(1)
    r = lean_path.census((64, 256) * 4 + (64,), tokens=256, more_layers=1, warmup=1)
    assert r["extra_aten_calls_per_gemm"] <= 4.7, r["extra_aten_calls_per_gemm"]
    assert r["passes_by_op"]["fused_cast"] == pytest.approx(1.0)  # every operand (before: 0.67), one pass


_SLOW = pytest.mark.slow  # (each case compiles its kernels: a few seconds each on 2 cores)


@pytest.mark.parametrize("encoding,x_dtype,dtype", [
    ("e4m3", torch.float32, torch.float32),
    pytest.param("e5m2", torch.float32, torch.float32, marks=_SLOW),
    pytest.param("e4m3", torch.bfloat16, torch.float32, marks=_SLOW),
    pytest.param("e5m2", torch.float32, torch.bfloat16, marks=_SLOW),
])  # fmt: skip
def test_direct_calls_give_the_eager_bits_at_any_shape(encoding, x_dtype, dtype) -> None:
    """One compiled variant serves every shape, called directly after the first (no dynamo): the hard
    values (every FP8 value, tie, neighbour, NaN, saturation) cast at several shapes, transposed copies
    and amax included, bit for bit the eager kernels'; shapes the first graph does not cover (a
    dimension of 1, 3-D) go through dynamo, with the same bits."""
    hard = _hard_values(encoding).to(x_dtype)
    calls_before = None
    for rows, cols in ((64, 96), (72, 64), (2048, 3), (1, 4500)):
        x = hard[: rows * cols].reshape(rows, cols) * 1.0
        for scale in (torch.tensor(3.0), torch.tensor(2.0**-7)):
            values, values_t, amax_out = _cast_and_amax(x, scale, encoding, dtype, True)
            want, want_t, want_amax = _eager(_cast_and_amax, x, scale, encoding, dtype, True)
            assert bool(_same_bits(values, want).all()) and bool(_same_bits(values_t, want_t).all())
            assert values_t.is_contiguous() and _same_bits(amax_out, want_amax).all()
        kernel = cast.COMPILED_KERNELS.compiled[cast._recording_kernel, (x_dtype, dtype, encoding, True)]
        if calls_before is None:
            calls_before = kernel.direct_calls
    assert kernel.direct_calls >= calls_before + 4  # (64, 96)'s second call on: the graph, directly
    x3 = hard[: 8 * 16 * 40].reshape(8, 16, 40)
    got, _ = cast.cast_with_amax(x3, torch.tensor(3.0), encoding, dtype, transposed=False, amax_out=None)
    want, _ = _eager(cast.cast_with_amax, x3, torch.tensor(3.0), encoding, dtype, transposed=False,
                     amax_out=None)  # fmt: skip
    assert bool(_same_bits(got, want).all())


@pytest.mark.parametrize("out_dtype,bias_dtype", [
    (torch.float32, None),
    (torch.float32, torch.float32),
    pytest.param(torch.bfloat16, None, marks=_SLOW),
    pytest.param(torch.bfloat16, torch.bfloat16, marks=_SLOW),
])  # fmt: skip
def test_compiled_gemm_output_equals_the_eager_epilogue(out_dtype, bias_dtype) -> None:
    """The bf16 path's output with fp32 operands (a CPU without bf16 instructions): rounded to bf16,
    scaled by the product of the two scales, the bias added after, in one call (the scales' product
    folded in: where eagerly that is up to five calls), bit for bit the eager epilogue's; from 4096
    output elements (the tiny GPT's smallest GEMM outputs)."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(64, 96, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    b = (torch.randn(96, 64, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    sa, sb = torch.tensor(0.0371), torch.tensor(2.75)
    bias = None if bias_dtype is None else torch.randn(64, generator=g).to(bias_dtype)
    assert 64 * 64 >= cast.FUSED_MIN_ELEMENTS and gemm_output.fused_output_applies(a, sa, bias)
    for _ in range(2):  # the compiling call, then the direct one
        with StepCensus() as census:
            got = gemm.gemm(a, sa, b, sb, out_dtype, bias, bf16_output=True)
        want = _eager(gemm.gemm, a, sa, b, sb, out_dtype, bias, bf16_output=True)
        assert got.dtype == out_dtype and torch.equal(got, want)
        # (out of place under a dispatch mode, the census: a mode may hold the product)
        assert census.ops["scaled_output"] == 1 and census.calls == 2, census.ops  # mm and the output
    key = (torch.float32, out_dtype) + (() if bias is None else (bias.dtype,))
    kernel = gemm_output._output_kernel if bias is None else gemm_output._biased_output_kernel
    assert cast.COMPILED_KERNELS.compiled[kernel, key].direct_calls >= 1  # the second call, directly


@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_gemm_output_written_into_the_product_has_the_out_of_place_bits(bias_dtype, monkeypatch) -> None:
    """Where the output dtype is the product's (fp32), `gemm` writes its epilogue into the fresh
    product of its torch.mm (no second output-sized buffer: the output's memory is the mm's), with
    the bits of the out-of-place kernel and of torch's eager epilogue: shapes off 8, one row, a bias
    of either dtype, called directly after the first call; a bf16 output stays a new tensor."""
    g = torch.Generator().manual_seed(11)
    products: list = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: products.append(mm(a, b)) or products[-1])
    sa, sb = torch.tensor(0.0371), torch.tensor(2.75)
    for m, k, n in ((67, 40, 123), (1, 24, 4500), (67, 40, 123)):
        a = (torch.randn(m, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        b = (torch.randn(k, n, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
        for out_dtype in (torch.float32, torch.bfloat16):
            products.clear()
            got = gemm.gemm(a, sa, b, sb, out_dtype, bias, bf16_output=True)
            assert len(products) == 1
            in_place = got.data_ptr() == products[0].data_ptr()
            assert in_place == (out_dtype == torch.float32), (m, n, out_dtype)
            out_of_place = gemm_output.scaled_output(mm(a, b), sa, sb, bias, out_dtype)
            eager = _eager(gemm.gemm, a, sa, b, sb, out_dtype, bias, bf16_output=True)
            assert got.dtype == out_dtype and torch.equal(got, out_of_place) and torch.equal(got, eager)
            assert bool(_same_bits(got, eager).all())
    key = (torch.float32,) + (() if bias_dtype is None else (bias_dtype,))
    kernel = gemm_output._output_kernel_ if bias_dtype is None else gemm_output._biased_output_kernel_
    assert cast.COMPILED_KERNELS.compiled[kernel, key].direct_calls >= 1  # (67, 123)'s second call


def test_a_product_autograd_records_is_not_written_over(monkeypatch) -> None:
    """Operands that require grad (not fp8train's casts, which never do) make a product autograd has
    recorded: its memory is not written over (the output is a new tensor), the values the same."""
    products: list = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: products.append(mm(a, b)) or products[-1])
    a = torch.randn(64, 32).to(torch.float8_e4m3fn).float().requires_grad_()
    b = torch.randn(32, 80).to(torch.float8_e4m3fn).float()
    sa, sb = torch.tensor(0.5), torch.tensor(0.125)
    for _ in range(2):
        products.clear()
        got = gemm.gemm(a, sa, b, sb, torch.float32, None, bf16_output=True)
        assert got.data_ptr() != products[0].data_ptr()
        assert torch.equal(got, _eager(gemm.gemm, a, sa, b, sb, torch.float32, None, bf16_output=True))


def test_gemm_output_not_written_into_the_product_under_a_dispatch_mode() -> None:
    """Under a dispatch mode (a counter) the epilogue is the out-of-place op `fp8train::scaled_output`
    (a mode may hold the mm's output: selective activation checkpointing caches it): one call beside
    the mm, a new tensor, the same bits."""
    g = torch.Generator().manual_seed(12)
    a = (torch.randn(64, 32, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    b = (torch.randn(32, 80, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    sa, sb, bias = torch.tensor(0.5), torch.tensor(0.125), torch.randn(80, generator=g)
    with StepCensus() as census:
        got = gemm.gemm(a, sa, b, sb, torch.float32, bias, bf16_output=True)
    assert census.ops["scaled_output"] == 1 and census.calls == 2, census.ops
    assert torch.equal(got, _eager(gemm.gemm, a, sa, b, sb, torch.float32, bias, bf16_output=True))


def test_selective_checkpoint_cache_of_the_product_is_not_written_over() -> None:
    """Selective activation checkpointing with a policy that saves matmuls (torch's own example) caches
    the mm's output and returns it at the recomputation: the in-place epilogue must not write over it
    (cf08600 did: "Tensor cached during selective activation checkpoint has been mutated")."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    g = torch.Generator().manual_seed(13)
    sa, sb = torch.tensor(0.5), torch.tensor(0.125)
    b = (torch.randn(32, 80, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).float()

    class FP8Product(torch.autograd.Function):  # (as fp8train's layers: operands without grad)
        @staticmethod
        def forward(ctx, x):
            a = x.detach().to(torch.float8_e4m3fn).float()
            return gemm.gemm(a, sa, b, sb, torch.float32, None, bf16_output=True)

        @staticmethod
        def backward(ctx, grad):
            return grad @ b.t()

    def block(x):
        y = FP8Product.apply(x)
        return y * y  # (saves y: recomputed in the backward)

    def policy(ctx, op, *args, **kwargs):
        save = op == torch.ops.aten.mm.default
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    x = (torch.randn(64, 32, generator=g) * 40).clamp(-448, 448).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    block(x_ref).sum().backward()
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    checkpoint(block, x, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_directly_called_falls_back_to_dynamo_where_the_graph_does_not_fit() -> None:
    """`DirectlyCalled`: the first call traces; calls whose tensors match the traced graph (dtype,
    dimensions, dynamic sizes of at least 2) call the graph directly; others go through dynamo, which
    compiles what they need: the same values either way."""

    def doubled_sum(x, y, scale=2.0):
        return (x * scale + y.sum(),)

    kernel = DirectlyCalled(doubled_sum, {})
    x, y = torch.randn(8, 4), torch.tensor([1.5, -2.25, 0.5])  # (a sum exact in any order)
    assert torch.equal(kernel(x, y)[0], x * 2.0 + y.sum()) and kernel.direct_calls == 0
    for shape in ((5, 7), (8, 4)):
        x = torch.randn(shape)
        assert torch.equal(kernel(x, y)[0], x * 2.0 + y.sum())
    assert kernel.direct_calls == 2
    others = ((torch.randn(1, 4), y), (torch.randn(8, 4).double(), y.double()), (torch.randn(2, 3, 4), y))
    for x, z in others:
        assert torch.equal(kernel(x, z)[0], x * 2.0 + z.sum())
    assert kernel.direct_calls == 2  # a size of 1, float64, 3-D: dynamo's calls

    def biased(y, bias):  # the trace proves bias's size equal to y's columns: one input for both
        return (y + bias,)

    kernel = DirectlyCalled(biased, {})
    for rows, cols in ((8, 4), (5, 7), (6, 9)):
        y, bias = torch.randn(rows, cols), torch.randn(cols)
        assert torch.equal(kernel(y, bias)[0], y + bias)
    assert kernel.direct_calls == 2
    with pytest.raises(RuntimeError, match="size of tensor"):  # checked equal: dynamo's call, torch's error
        kernel(torch.randn(6, 9), torch.randn(8))
    assert kernel.direct_calls == 2


def test_direct_calls_skip_the_compiled_graphs_wrapper_but_under_the_profiler(monkeypatch) -> None:
    """A direct call runs inductor's generated code (`current_callable`) without
    `CompiledFxGraph.__call__`'s wrapper (its autotune and metrics bookkeeping: time on every call),
    except under torch.profiler, where the wrapper's label names the graph; a function that writes
    into its argument (`x.copy_`) is called directly too, writing into the argument's own memory."""
    from torch._inductor.output_code import CompiledFxGraph

    wrapped, call = [], CompiledFxGraph.__call__
    monkeypatch.setattr(CompiledFxGraph, "__call__", lambda g, inputs: wrapped.append(1) or call(g, inputs))

    def halved(x, scale):
        x.copy_(x * scale.reshape(()) + 0.5)
        return ()

    kernel, scale = DirectlyCalled(halved, {}), torch.tensor(0.5)
    for shape in ((8, 5), (7, 9), (7, 9)):
        x = torch.randn(shape)
        want, address = x * 0.5 + 0.5, x.data_ptr()
        assert kernel(x, scale) == () and torch.equal(x, want) and x.data_ptr() == address
    assert kernel.direct_calls == 2 and len(wrapped) == 1  # (the first call: dynamo's, wrapped)
    with torch.profiler.profile() as prof:
        kernel(x, scale)
    assert kernel.direct_calls == 3 and len(wrapped) == 2
    assert any("CompiledFxGraph" in e.name for e in prof.events())


def test_a_first_call_with_a_dimension_of_1_leaves_later_calls_direct() -> None:
    """A first call with a size of 1 (a one-token batch, a one-output head's weight): dynamo
    specializes that dimension, so its graph fits no other size there; the direct calls are taken by
    the graph dynamo compiles for the next shape instead of being given up for good (before: the
    specialized graph was called for every shape, asserted against, and dropped)."""

    def shifted(x, scale):
        return (x * scale.reshape(()) + 1.0,)

    kernel, scale = DirectlyCalled(shifted, {}), torch.tensor(2.0)
    for shape in ((1, 50), (64, 96), (3, 50), (64, 96)):
        x = torch.randn(shape)
        assert torch.equal(kernel(x, scale)[0], x * 2.0 + 1.0)
    assert kernel.direct_calls == 2 and kernel.graph is not None  # (3, 50) and (64, 96)'s second call


def test_a_call_from_another_thread_while_the_graph_is_kept_is_direct() -> None:
    """The backend publishes the graph last, after how to call it: a call from another thread (here:
    made at the moment `graph` is set) sees a graph it can call, not one called the wrong way, which
    raised and dropped the direct calls for good."""

    class Observed(DirectlyCalled):
        seen: list = []

        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "graph" and value is not None and not self.seen:
                self.seen.append(self(torch.ones(6, 5))[0])  # (another thread's call, at this moment)

    kernel = Observed(lambda x: (x + 1.0,), {})
    x = torch.randn(4, 3)
    assert torch.equal(kernel(x)[0], x + 1.0) and torch.equal(Observed.seen[0], torch.full((6, 5), 2.0))
    assert torch.equal(kernel(x)[0], x + 1.0)
    assert kernel.direct_calls == 2 and kernel.graph is not None


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_operands_under_64k_elements_give_the_eager_bits_in_every_mode(recipe) -> None:
    """Operands of 6K-12K elements (under the old 64K threshold, over the new 4K one) in a
    LayerNormMLP, delayed and current per-tensor scaling: under bf16 autocast, with
    torch.utils.checkpoint (the recomputed forward casts again: the same bits in the replay) and
    with create_graph=True, outputs and every gradient bit for bit those of torch's eager kernels."""
    import copy

    from torch.utils.checkpoint import checkpoint

    import fp8train

    def step(module, mode):
        x = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")
        make = fp8train.DelayedScaling if recipe == "delayed" else fp8train.Float8CurrentScaling
        with amp, fp8train.fp8_autocast(fp8_recipe=make()):
            y = checkpoint(module, x, use_reentrant=False) if mode == "checkpoint" else module(x)
        loss = y.float().square().mean()
        if mode == "create_graph":
            (dx,) = torch.autograd.grad(loss, x, create_graph=True)
            dx.square().sum().backward()
        else:
            loss.backward()
        return [y.detach(), x.grad] + [p.grad for p in module.parameters()]

    torch.manual_seed(0)
    module = fp8train.LayerNormMLP(64, 128)
    for mode in ("autocast", "checkpoint", "create_graph"):
        fused, eager = copy.deepcopy(module), copy.deepcopy(module)
        for _ in range(2):  # (delayed scaling: the second step casts with the first one's amax)
            direct = sum(k.direct_calls for k in cast.COMPILED_KERNELS.compiled.values())
            got = step(fused, mode)
            direct = sum(k.direct_calls for k in cast.COMPILED_KERNELS.compiled.values()) - direct
            want = _eager(step, eager, mode)
        assert direct >= 6, (mode, direct)  # the compiled kernels ran (their direct calls)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), mode


def test_a_torch_without_the_graph_introspection_keeps_the_dynamo_call(monkeypatch) -> None:
    """The placeholders' sources are private dynamo API: on a torch where reading them fails (here:
    an attribute renamed), the compiled kernel still runs, through dynamo (not a failed compile,
    which would put every cast on torch's eager kernels for the rest of the process)."""
    from fp8train import torch_internals

    def renamed(gm, names):
        raise AttributeError("'GraphArg' object has no attribute 'source'")

    monkeypatch.setattr(torch_internals, "_graph_inputs", renamed)
    kernel = DirectlyCalled(lambda x: (x * 2.0,), {})
    for shape in ((4, 3), (5, 7), (5, 7)):
        x = torch.randn(shape)
        assert torch.equal(kernel(x)[0], x * 2.0)
    assert kernel.direct_calls == 0 and kernel.graph is None


class _Wrapper(torch.Tensor):
    """A wrapper subclass without memory of its own (as FSDP2's gathered weight, fsdp.GatheredWeight):
    every op unwraps it."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor) -> None:
        self.data_ = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.data_ if isinstance(t, _Wrapper) else t

        tree_map = torch.utils._pytree.tree_map
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_a_tensor_subclass_is_cast_by_its_own_ops_not_read_as_memory() -> None:
    """A wrapper subclass has no memory of its own: a compiled kernel called directly would read a null
    or foreign pointer (FSDP2's high-precision gathered weights crashed the process so). Its cast takes
    torch's ops, with the plain tensor's bits, and the kernel kept for plain tensors serves them after."""
    x, scale = torch.randn(64, 96) * 30, torch.tensor(2.0)
    plain, _, amax_plain = _cast_and_amax(x, scale, "e4m3", torch.float32, False)
    key = (torch.float32, torch.float32, "e4m3", False)
    kernel = cast.COMPILED_KERNELS.compiled[cast._recording_kernel, key]
    assert kernel.graph is not None  # kept for direct calls
    calls = kernel.direct_calls
    wrapped, _, amax_wrapped = _cast_and_amax(_Wrapper(x.clone()), scale, "e4m3", torch.float32, False)
    assert kernel.direct_calls == calls  # torch's ops cast it
    assert bool(_same_bits(wrapped, plain).all()) and bool(_same_bits(amax_wrapped, amax_plain).all())
    _cast_and_amax(x, scale, "e4m3", torch.float32, False)
    assert kernel.graph is not None and kernel.direct_calls == calls + 1  # plain tensors: still direct


@pytest.mark.parametrize("rows", [64, 8])  # the compiled kernel (64 x 96), torch's eager kernels (8 x 96)
def test_a_cast_maxes_its_amax_into_the_slot_it_is_given(rows) -> None:
    """`cast_with_amax(..., amax_out=slot)`: max|x| MAXed into the slot (a recording slot: a 0-dim view
    into the storage of every column) in the cast's own call: a larger value recorded earlier stays,
    a smaller one is replaced, a NaN of x is recorded as NaN and stays; the other columns untouched;
    under a dispatch mode the op writes it alike; the values those of a cast without a slot."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(rows, 96, generator=g) * 30
    scale, encoding = torch.tensor(2.0), "e4m3"
    want_amax = float(x.abs().max())
    recording = torch.tensor([1.0, 2.0 * want_amax, 0.5, 7.0])
    slots = recording.unbind()
    plain, _ = cast.cast_with_amax(x, scale, encoding, torch.float32, transposed=False, amax_out=None)
    for _ in range(2):  # (the compiling call, then the direct one)
        values, _ = cast.cast_with_amax(x, scale, encoding, torch.float32, transposed=False,
                                        amax_out=slots[1])  # fmt: skip
        assert bool(_same_bits(values, plain).all())
    cast.cast_with_amax(x, scale, encoding, torch.float32, transposed=False, amax_out=slots[2])
    half = x * 0.5
    with StepCensus() as census:
        cast.cast_with_amax(half, scale, encoding, torch.float32, transposed=False, amax_out=slots[3])
    if rows == 64:  # the compiled kernel, as its op: one call
        assert census.calls == 1 and census.ops["fused_cast"] == 1, census.ops
    assert recording.tolist() == [1.0, 2.0 * want_amax, want_amax, 0.5 * want_amax]
    x[3, 5] = float("nan")
    cast.cast_with_amax(x, scale, encoding, torch.float32, transposed=False, amax_out=slots[0])
    cast.cast_with_amax(x * 0.0, scale, encoding, torch.float32, transposed=False, amax_out=slots[0])
    assert recording[0].isnan() and recording[1:].tolist() == [2.0 * want_amax, want_amax, 0.5 * want_amax]
    if rows == 64:
        key = (torch.float32, torch.float32, "e4m3", False)
        assert cast.COMPILED_KERNELS.compiled[cast._recording_kernel, key].direct_calls >= 3


def test_a_direct_call_checks_the_layout_inductor_no_longer_asserts() -> None:
    """Inductor's per-input size and stride asserts are compiled out: the direct call checks the layout.
    A tensor of the traced dtype and dimensions but not contiguous (a transpose, a column slice) is
    not given to the graph (which would read it as contiguous) but to dynamo's call: the right values;
    a function first traced with such a tensor keeps no direct call."""
    kernel = DirectlyCalled(lambda x, y: (x * 2.0 + y,), {})
    x, y = torch.randn(6, 5), torch.randn(6, 5)
    kernel(x, y)
    assert kernel.graph is not None
    calls = kernel.direct_calls
    assert torch.equal(kernel(x, y)[0], x * 2.0 + y) and kernel.direct_calls == calls + 1
    for other in (torch.randn(5, 6).t(), torch.randn(6, 10)[:, ::2]):
        assert not other.is_contiguous()
        assert torch.equal(kernel(other, y)[0], other * 2.0 + y)
        assert torch.equal(kernel(y, other)[0], y * 2.0 + other)
    assert kernel.direct_calls == calls + 1 and kernel.graph is not None  # dynamo's calls, the graph kept
    first_strided = DirectlyCalled(lambda x: (x + 1.0,), {})
    t = torch.randn(5, 6).t()
    assert torch.equal(first_strided(t)[0], t + 1.0) and first_strided.graph is None
    assert torch.equal(first_strided(t.contiguous())[0], t + 1.0)


def test_a_graph_traced_for_a_strided_call_is_not_kept_when_another_thread_calls_meanwhile() -> None:
    """Whether a compiled graph may be called directly is decided by the tensors the graph was traced
    with, not by the last call that began tracing: a call from another thread with contiguous tensors,
    made while a strided call is being traced (it waits on dynamo's lock), does not let the strided
    call's graph (which reads its input as transposed) be kept for contiguous tensors."""

    class Raced(DirectlyCalled):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "_traced_contiguous" and value is False:  # another thread's contiguous call, now
                super().__setattr__(name, True)

    kernel = Raced(lambda x: (x + 1.0,), {})
    strided = torch.randn(96, 64).t()
    assert torch.equal(kernel(strided)[0], strided + 1.0)
    for _ in range(2):
        x = torch.randn(64, 96)
        assert torch.equal(kernel(x)[0], x + 1.0)

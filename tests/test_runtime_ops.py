"""runtime.ops on the CPU: the ``moe_build::moe_layer`` custom op over a
stand-in layer (the ``runtime.chunks`` protocol, computing a per-token
function of its inputs on CPU tensors, a table of M = 1..64, whose calls
``check_call`` checks as the real layer's): schema, fake implementation under FakeTensorMode (shapes,
dtypes, device, refusals), ``torch.library.opcheck``, ``torch.compile
(fullgraph=True)`` of ``MoEModule`` (the traced graph calls the op once per
call and gives eager's values), and the handle table."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import seeding
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from runtime import ops
from runtime.errors import InputError
from runtime.inputs import check_call

H, E = 256, 32
OP = torch.ops.moe_build.moe_layer


class StandIn:
    """A layer of the chunks protocol: its table serves M in 1..64 (each call
    checked by ``check_call``), output row t = bf16(2 x[t] + logits[t, 0] + bias[0]), a
    function of token t alone; records each call's M."""

    def __init__(self, device="cpu", dtypes=("float32", "bfloat16")):
        self.shape = SimpleNamespace(hidden=H, experts=E, bias=True)
        self.device = torch.device(device)
        self.dtypes = dtypes
        self.tables = {d: dict.fromkeys(range(1, 65)) for d in dtypes}
        self.calls = []

    def __call__(self, x, logits, bias):
        self.calls.append(check_call(x, logits, bias, self.shape, self.device, self.dtypes))
        return expected(x, logits, bias)


def expected(x, logits, bias):
    return (x.float() * 2 + logits[:, :1].float() + bias[0]).to(torch.bfloat16)


def _inputs(m, dtype=torch.float32, device="cpu"):
    g = seeding.generator(f"{seeding.current_test()}:{m}:{dtype}")
    x = torch.randn(m, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(m, E, generator=g).to(dtype)
    bias = torch.randn(E, generator=g) * 0.1
    return x.to(device), logits.to(device), bias.to(device)


@pytest.fixture
def layer():
    stand_in = StandIn()
    handle = ops.register(stand_in)
    yield stand_in, handle
    if handle in ops.registered():
        ops.unregister(handle)


def test_schema_declares_no_mutation_or_aliasing():
    schema = OP.default._schema
    assert str(schema) == (
        "moe_build::moe_layer(Tensor x, Tensor logits, Tensor? bias, int handle) -> Tensor"
    )
    assert not schema.is_mutable
    assert all(a.alias_info is None for a in (*schema.arguments, *schema.returns))


@pytest.mark.parametrize("m", [0, 1, 3, 64, 65, 150])
def test_real_impl_chunks_through_the_layer(layer, m):
    stand_in, handle = layer
    x, logits, bias = _inputs(m)
    got = OP(x, logits, bias, handle)
    assert torch.equal(got, expected(x, logits, bias))
    assert stand_in.calls == [64] * (m // 64) + ([m % 64] if m % 64 else [])


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_fake_impl_gives_shape_dtype_device_without_calling(device):
    """Under FakeTensorMode (fake CUDA tensors need no GPU), the op gives an
    empty BF16 [M, H] on x's device for any M, and never calls the layer."""
    stand_in = StandIn(device)
    handle = ops.register(stand_in)
    try:
        with FakeTensorMode():
            for m in (0, 1, 64, 65, 300):
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.empty(m, H, dtype=torch.bfloat16, device=device)
                    logits = torch.empty(m, E, dtype=dtype, device=device)
                    bias = torch.empty(E, dtype=torch.float32, device=device)
                    y = OP(x, logits, bias, handle)
                    assert y.shape == (m, H) and y.dtype == torch.bfloat16
                    assert y.device == torch.device(device) and y.is_contiguous()
        assert stand_in.calls == []
    finally:
        ops.unregister(handle)


def _bad_cases():
    """(name, args builder, message) of inputs both implementations refuse."""
    return [
        ("x dtype", lambda x, l, b: (x.float(), l, b), "x: expected dtype torch.bfloat16"),
        ("x rank", lambda x, l, b: (x.view(-1), l, b), r"x: expected a \[M, 256\] tensor"),
        ("hidden", lambda x, l, b: (x[:, :128], l, b), r"x: expected shape \[5, 256\]"),
        ("no rows", lambda x, l, b: (x[:0], l[:1], b), r"logits: expected shape \[0, 32\]"),
        ("logits rows", lambda x, l, b: (x, l[:4], b), r"logits: expected shape \[5, 32\]"),
        ("logits dtype", lambda x, l, b: (x, l.half(), b), "logits: expected dtype torch.float32 or torch.bfloat16"),
        ("bias shape", lambda x, l, b: (x, l, b[:8]), r"bias: expected shape \[32\], found \[8\]"),
        ("bias dtype", lambda x, l, b: (x, l, b.bfloat16()), "bias: expected dtype torch.float32"),
        ("device", lambda x, l, b: (x.to("meta"), l, b), "x: expected device cpu, found meta"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_both_impls_refuse_bad_inputs_alike(layer, case):
    _, handle = layer
    _, edit, message = case
    args = edit(*_inputs(5))
    with pytest.raises(InputError, match=message):
        OP(*args, handle)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) for a in args]
        with pytest.raises(InputError, match=message):
            OP(*fake, handle)


@pytest.mark.parametrize("m", [0, 3, 64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(layer, m, dtype):
    """torch.library.opcheck: schema (no mutation, no aliasing), autograd
    registration, fake vs real, and AOT dispatch with dynamic shapes."""
    _, handle = layer
    torch.library.opcheck(OP.default, (*_inputs(m, dtype), handle))


def _op_nodes(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target in (OP, OP.default))


def test_compiled_module_traces_the_op_once_per_call():
    """``torch.compile(fullgraph=True)`` of a function calling two modules:
    the captured graph holds exactly two op calls and nothing runs in
    Python between them; compiled results equal eager ones, with
    aot_eager too, for M across the chunking boundary."""
    first, second = StandIn(), StandIn()
    a, b = ops.MoEModule(first), ops.MoEModule(second)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def model(x, logits, bias):
        return b(a(x, logits, bias), logits, bias)

    x, logits, bias = _inputs(100)
    want = model(x, logits, bias)
    torch._dynamo.reset()
    got = torch.compile(model, fullgraph=True, backend=counting)(x, logits, bias)
    assert torch.equal(got, want)
    assert len(graphs) == 1 and _op_nodes(graphs[0]) == 2
    compiled = torch.compile(a, fullgraph=True, backend="aot_eager")
    for m in (1, 7, 64, 65, 130):
        x, logits, bias = _inputs(m)
        assert torch.equal(compiled(x, logits, bias), a(x, logits, bias)), m
    a.close()
    b.close()


def test_module_holds_bias_and_releases_its_handle():
    stand_in = StandIn()
    x, logits, bias = _inputs(4)
    module = ops.MoEModule(stand_in, bias=bias)
    handle = module.handle
    assert module.layer is stand_in and handle in ops.registered()
    assert torch.equal(module(x, logits), expected(x, logits, bias))
    assert torch.equal(module(x, logits, bias * 0), expected(x, logits, bias * 0))
    assert "bias" not in module.state_dict()
    with pytest.raises(InputError, match="bias: none given"):
        ops.MoEModule(stand_in)(x, logits)
    del module
    gc.collect()
    assert handle not in ops.registered()


def test_unknown_handles_are_refused_clearly(layer):
    _, handle = layer
    x, logits, bias = _inputs(2)
    message = r"moe_build::moe_layer: handle 987654 names no registered layer \(registered: .*\d"
    with pytest.raises(InputError, match=message):
        OP(x, logits, bias, 987654)
    with FakeTensorMode() as mode, pytest.raises(InputError, match=message):
        OP(*(mode.from_tensor(t) for t in (x, logits, bias)), 987654)
    with pytest.raises(InputError, match="handle 987654 names no registered layer"):
        ops.unregister(987654)
    module = ops.MoEModule(StandIn())
    module.close()
    with pytest.raises(InputError, match=f"handle {module.handle} names no registered layer"):
        module(x, logits, bias)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=f"handle {module.handle} names no registered layer"):
        torch.compile(module, fullgraph=True, backend="eager")(x, logits, bias)
    with pytest.raises(TypeError, match="register: expected a bound layer"):
        ops.register(object())

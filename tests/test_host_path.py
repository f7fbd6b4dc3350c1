"""The eager host path of a layer call (runtime/moe.py, docs/notes/host-path.md)
on the CPU: the per-(variant, stream) call plans launch exactly what a fill
of every parameter by name gives, and are made again for another stream, for
remade workspaces and per variant; threads sharing a plan launch their own
addresses; a call's outputs are views of one fresh block, apart and aligned;
a launch into a capture still makes the graph hold the layer, and the
driver's capture query is skipped only when torch proves there is no
capture; the device's context is pushed only when it is not current; the
input checks refuse, after accepting a call, what they refused before."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time

import pytest
import runtime_fixtures as fx
import seeding
import torch
from driver_fakes import artifact, fake_devices, launch_args, move, weights_on
from layer_fakes import FakeArtifact, TaggedLayer

import runtime.inputs
from benchmarks.host_path import NullDriver, cpu_layer, inputs, variants
from runtime import driver, graphs
from runtime.constants import MAX_TOKENS, VALID
from runtime.errors import InputError
from runtime.inputs import ALIGN, check_call, check_weights
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.moe import OUTPUT_ALIGN, OUTPUTS, OutputLayout, _Block, takes_valid
from runtime.plan import pad_rows, pad_sources

SHAPE = MoEShape(**fx.SMALL_MODEL)
CPU = torch.device("cpu")
BOTH = ("float32", "bfloat16")
I32 = "mega-sm_90a-m2-float32"


@pytest.fixture
def fake(monkeypatch):
    with fake_devices(monkeypatch) as fake:
        yield fake


@pytest.fixture(scope="module")
def weights():
    return random_moe_weights(SHAPE, seeding.generator(f"{__name__}.weights"))[0]


def _records():
    """mega m1, mega m2 that also takes the i32 scalars (its own entry, so
    the fake knows its parameter names), grouped m8 with and without
    finalize."""
    params = [{"name": p, "kind": "pointer"} for p in fx.MEGA_PARAMS]
    params += [{"name": "tokens", "kind": "i32"}, {"name": "routes", "kind": "i32"}]
    return [
        (fx.record("mega", tokens=1), fx.cubin("m1")),
        (fx.record("mega", tokens=2, entry="moe_mega_i32", params=params), fx.cubin("m2")),
        (fx.record("grouped", tokens=8), fx.cubin("g8")),
        (fx.record("grouped", tokens=8, finalize=True), fx.cubin("g8f")),
    ]


def _layer(tmp_path, fake, weights, ordinal=0):
    art = artifact(tmp_path, fake, device=f"cuda:{ordinal}", records=_records())
    return art.bind(weights_on(weights, ordinal))


def _by_name(layer, variant, stream, x, logits, bias, block) -> dict:
    """What filling every parameter of ``variant`` by name gives (the
    layer's fill before it kept plans): i32 scalars from the bucket, the
    stream's workspaces, else the address of the tensor of that name
    (weights, row tables, maps, the call's inputs and outputs)."""
    layout = layer.layouts[variant.name]
    named = {**layer.tensors, **layer.rows, "maps": layer.maps[variant.tensor_maps],
             "x": x, "logits": logits, "bias": bias}  # fmt: skip
    addresses = {n: t.data_ptr() for n, t in named.items()}
    addresses.update({n: layout.view(block, n).data_ptr() for n in OUTPUTS})
    spaces = layer.artifact.workspaces(layer.ordinal).pointers(stream, variant)
    scalars = {"tokens": variant.tokens, "routes": variant.tokens * SHAPE.top_k,
               "valid": x.shape[0]}  # fmt: skip
    return {
        name: scalars[name] if kind == "i32" else spaces.get(name, addresses.get(name))
        for name, kind in variant.params
    }


# Plans ----------------------------------------------------------------------------------


def test_plans_launch_what_a_fill_by_name_gives(tmp_path, fake, weights):
    """Every variant, interleaved, each call with tensors of its own (kept
    alive, so no address repeats): the launched values are the by-name
    fill's, the per-call slots rewritten and the rest kept."""
    layer = _layer(tmp_path, fake, weights)
    fake.make_current(0)
    v = layer.variants
    order = ["mega-sm_90a-m1-float32", I32, "grouped-sm_90a-m8-float32",
             "grouped-sm_90a-m8-float32-final", "mega-sm_90a-m1-float32",
             "grouped-sm_90a-m8-float32-final", I32]  # fmt: skip
    kept = []
    for name in order:
        args = launch_args(layer, v[name], 0)
        kept.append(args)
        layer._launch(v[name], *args)
        function, stream, context, values = fake.launches[-1]
        assert function == ("function", v[name].entry, 0) and context == 0
        assert values == _by_name(layer, v[name], stream, *args), name
    assert fake.launches[1][3]["tokens"] == 2 and fake.launches[1][3]["routes"] == 2 * SHAPE.top_k
    assert set(layer._plans) == {(n, 0x5000, False) for n in order}
    # The grouped kernel without finalize gets one pointer for final and shared_out.
    plain, final = fake.launches[2][3], fake.launches[3][3]
    assert plain["final"] == plain["shared_out"] and final["final"] != final["shared_out"]


def test_a_plan_per_stream(tmp_path, fake, weights):
    layer = _layer(tmp_path, fake, weights)
    fake.make_current(0)
    v = layer.variants["grouped-sm_90a-m8-float32-final"]
    counters, plans, kept = {}, {}, []
    for stream in (0x5000, 0x7000, 0x5000, 0x7000, 0x5000):
        fake.streams[0] = stream
        args = launch_args(layer, v, 0)
        kept.append(args)
        layer._launch(v, *args)
        _, launched, _, values = fake.launches[-1]
        assert launched == stream
        assert values == _by_name(layer, v, stream, *args)
        assert counters.setdefault(stream, values["counters"]) == values["counters"]
        assert (
            plans.setdefault(stream, layer._plans[(v.name, stream, False)])
            is layer._plans[(v.name, stream, False)]
        ), "a stream's plan was made again"
    assert counters[0x5000] != counters[0x7000]
    assert plans[0x5000] is not plans[0x7000]


def test_a_plan_is_remade_with_the_workspaces(tmp_path, fake, weights):
    """After ``Artifact.close`` frees the workspaces, a launch (the fake's
    functions still answer) must use the new ones, never a freed address."""
    layer = _layer(tmp_path, fake, weights)
    fake.make_current(0)
    v = layer.variants["grouped-sm_90a-m8-float32-final"]
    names = [w.name for w in v.workspace]
    first = launch_args(layer, v, 0)
    layer._launch(v, *first)
    old = {n: fake.launches[-1][3][n] for n in names}
    layer.artifact.close()
    freed = {p for _, p in fake.freed}
    assert set(old.values()) <= freed
    second = launch_args(layer, v, 0)
    layer._launch(v, *second)
    _, stream, _, values = fake.launches[-1]
    assert values == _by_name(layer, v, stream, *second)
    assert not {values[n] for n in names} & freed, "a freed workspace was launched"


def test_threads_sharing_a_plan_launch_their_own_addresses(tmp_path, fake, weights, monkeypatch):
    """Two threads, one layer, one stream, one variant: each launch carries
    the launching thread's tensors (the driver here yields before it reads
    the values, so unguarded slots would be overwritten)."""
    layer = _layer(tmp_path, fake, weights)
    fake.make_current(0)
    v = layer.variants["mega-sm_90a-m1-float32"]
    record = fake.launch

    def launch(function, config, stream, params):
        time.sleep(0.0005)
        record(function, config, stream, params)
        fake.launches[-1] += (threading.get_ident(),)

    monkeypatch.setattr(driver, "launch", launch)
    own, errors = {}, []

    def run():
        try:
            args = launch_args(layer, v, 0)
            own[threading.get_ident()] = args
            for _ in range(40):
                layer._launch(v, *args)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(fake.launches) == 80
    for _, stream, _, values, thread in fake.launches:
        assert values == _by_name(layer, v, stream, *own[thread])


# Outputs -------------------------------------------------------------------------------


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("bucket", [1, 3, 8, 64])
def test_output_layout(bucket, separate):
    """One block: every output at an OUTPUT_ALIGN multiple (itself a multiple
    of the kernels' ALIGN), no two overlapping, all inside the block; the
    shapes and dtypes the layer returned before; ``final`` is ``shared_out``
    exactly when the variant does not write it, else a tensor of its own
    (so the MoE output a caller keeps holds nothing else)."""
    k, h = 8, 4096
    layout = OutputLayout(bucket, k, h, separate)
    want = {"out": (torch.bfloat16, (bucket * k, h)), "ids": (torch.int32, (bucket, k)),
            "weights": (torch.float32, (bucket, k)), "shared_out": (torch.bfloat16, (bucket, h)),
            "final": (torch.bfloat16, (bucket, h))}  # fmt: skip
    in_block = [n for n in OUTPUTS if n != "final" or not separate]
    assert OUTPUT_ALIGN % ALIGN == 0 and sorted(layout.fields) == sorted(in_block)
    if not separate:
        assert layout.fields["final"] is layout.fields["shared_out"]
    spans = []
    for name, (offset, dtype, shape) in layout.fields.items():
        assert (dtype, shape) == want[name], name
        assert offset % OUTPUT_ALIGN == 0 and layout.offsets[name] == offset
        if name != "final":
            spans.append((offset, offset + dtype.itemsize * shape[0] * shape[1]))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    assert spans[-1][1] <= layout.nbytes and layout.nbytes % OUTPUT_ALIGN == 0
    block = layout.allocate(CPU)
    data = block.bytes if separate else block
    assert data.dtype == torch.uint8 and data.numel() == layout.nbytes
    for name in OUTPUTS:
        dtype, shape = want[name]
        full, some = layout.view(block, name), layout.view(block, name, 1)
        assert full.dtype == dtype and full.shape == shape and full.is_contiguous()
        assert some.shape == (1, shape[1]) and some.data_ptr() == full.data_ptr()
        if name == "final" and separate:
            assert full.untyped_storage().nbytes() == bucket * h * 2
            assert full.untyped_storage().data_ptr() != data.data_ptr()
        else:
            assert full.data_ptr() - data.data_ptr() == layout.fields[name][0]


@pytest.fixture
def null(monkeypatch):
    """The null driver in place; ``null.layer()`` binds a CPU layer whose
    artifact is closed (its fake workspaces freed) while it still is."""
    null = NullDriver().install(monkeypatch.setattr)
    made = []

    def layer():
        made.append(cpu_layer(SHAPE, variants(SHAPE)))
        return made[-1]

    null.layer = layer
    yield null
    for layer in made:
        layer.artifact.close()


def _launched(null, variant) -> dict:
    """The parameter values of the null driver's last launch, by name."""
    slots = (ctypes.c_void_p * len(variant.params)).from_address(null.last_params)
    return {n: ctypes.c_uint64.from_address(slots[i]).value
            for i, (n, _) in enumerate(variant.params)}  # fmt: skip


def _bytes(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


@pytest.mark.parametrize("m", [3, 4, 5, 8])
def test_calls_get_fresh_blocks_of_apart_outputs(null, m):
    """The real layer on the CPU: two calls' outputs are distinct tensors in
    distinct blocks; one call's outputs lie apart in its block, each at an
    OUTPUT_ALIGN offset from the block's start; the launch got the caller's
    x when M is a bucket or the variant takes ``valid`` (else a padded copy)
    and the outputs' addresses."""
    layer = null.layer()
    x, logits, bias = inputs(SHAPE, m)
    a, b = layer(x, logits, bias), layer(x, logits, bias)
    assert a.shape == b.shape == (m, SHAPE.hidden) and a.dtype == torch.bfloat16
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    variant = layer._variant(layer.tables["float32"][m], "float32")
    # The MoE output keeps only its own rows allocated: the bucket's, or M
    # where the variant takes ``valid`` (its finalize writes M rows alone).
    rows = m if takes_valid(variant) else variant.tokens
    assert a.untyped_storage().nbytes() == rows * SHAPE.hidden * 2
    values = _launched(null, variant)
    assert values["final"] == b.data_ptr()
    assert (values["x"] == x.data_ptr()) == (m == variant.tokens or takes_valid(variant))
    calls = [layer.grouped(x, logits, bias)]
    if m <= 4:
        calls.append(layer.mega(x, logits, bias, shared=True))
    for outs in calls:
        base = outs[0].untyped_storage().data_ptr()
        spans = sorted(_bytes(t) for t in outs)
        assert all(p[1] <= q[0] for p, q in zip(spans, spans[1:], strict=False)), spans
        assert all((t.data_ptr() - base) % OUTPUT_ALIGN == 0 for t in outs)
        assert all(t.untyped_storage().data_ptr() == base for t in outs)
        assert outs[1].dtype == torch.int32 and outs[1].shape == (m, SHAPE.top_k)


@pytest.mark.parametrize("m", [1, 8])
def test_a_call_returning_final_alone_writes_the_rest_to_the_streams_scratch(null, m):
    """A final-writing variant called for its MoE output alone (the layer
    call, ``grouped(finalize=True)``): one tensor a call (``final``, its own
    storage), the other outputs at the stream's scratch (``Workspaces.scratch``:
    the same address every call, as large as the largest final-writing
    variant's block, made once); the kernel entries that return those outputs
    keep getting blocks of their own."""
    layer = null.layer()
    x, logits, bias = inputs(SHAPE, m)
    variant = layer._variant(layer.tables["float32"][m], "float32")
    assert variant.name in layer.final_writers
    layout = layer.layouts[variant.name]
    seen = []
    for _ in range(3):
        final = layer(x, logits, bias)
        assert final.untyped_storage().nbytes() == variant.tokens * SHAPE.hidden * 2
        values = _launched(null, variant)
        assert values["final"] == final.data_ptr()
        names = ("out", "ids", "weights", "shared_out")
        seen.append({n: values[n] - layout.offsets[n] for n in names})
    bases = {b for call in seen for b in call.values()}
    assert len(bases) == 1, seen  # one block, at the layout's offsets, every call
    spaces = layer.artifact.workspaces(layer.ordinal)
    assert bases == {spaces.scratch(0x5000, layer._scratch_bytes)}
    # The buffer the calls got holds every final-writing variant's block.
    (size,) = [r[2] for r, p in spaces._buffers.items() if p in bases]
    assert all(size >= layer.layouts[n].nbytes for n in layer.final_writers)
    out = layer.grouped(x, logits, bias, finalize=True)
    assert _launched(null, layer._variant(layer._step("grouped", m, "float32", True),
                                          "float32"))["out"] in bases  # fmt: skip
    assert out.shape == (m, SHAPE.hidden)
    routed = layer.grouped(x, logits, bias)  # its own block: out, ids, weights, shared
    assert routed[0].data_ptr() not in bases


def test_the_scratch_is_remade_with_the_workspaces(null):
    """After ``Artifact.close`` frees the workspaces and the scratch, a call
    returning ``final`` alone gets a new scratch, never the freed one."""
    layer = null.layer()
    x, logits, bias = inputs(SHAPE, 8)
    variant = layer._variant(layer.tables["float32"][8], "float32")
    layer(x, logits, bias)
    old = _launched(null, variant)["out"]
    layer.artifact.close()
    layer(x, logits, bias)
    new = _launched(null, variant)["out"]
    spaces = layer.artifact.workspaces(layer.ordinal)
    assert new != old and new == spaces.scratch(0x5000, layer._scratch_bytes)


def test_poison_fills_every_output(weights):
    """``poison``: whatever the kernel leaves unwritten is NaN (ids -1)."""
    tensors = check_weights(weights, SHAPE, CPU)
    vs = variants(SHAPE)
    layer = TaggedLayer(FakeArtifact(vs), tensors, SHAPE, CPU, poison=True, skip=OUTPUTS)
    x, logits, bias = inputs(SHAPE, 2)
    out, ids, w, shared = layer.mega(x, logits, bias, shared=True)
    assert out.isnan().all() and w.isnan().all() and shared.isnan().all()
    assert (ids == -1).all()
    assert layer(x, logits, bias).isnan().all()


@pytest.mark.parametrize("m", [5, 8, 13, 50])
def test_a_grouped_call_below_its_bucket_launches_unpadded(null, m):
    """A grouped variant that takes ``valid`` gets the caller's x and logits
    (no padded copy) and ``valid`` = M, in the layer call and in
    ``layer.grouped``, and the MoE output is an M-row tensor of its own; the
    next call at the bucket's M writes ``valid`` back
    to the bucket (the plan's slot is rewritten every call, never left at an
    earlier call's M)."""
    layer = null.layer()
    x, logits, bias = inputs(SHAPE, m)
    final = layer._variant(layer.tables["float32"][m], "float32")
    routed = layer._variant(layer._step("grouped", m, "float32", False), "float32")
    assert final.kernel == routed.kernel == "grouped" and final.tokens == routed.tokens
    assert takes_valid(final) and takes_valid(routed)
    for call, variant in ((layer, final), (layer.grouped, routed)):
        got = call(x, logits, bias)
        values = _launched(null, variant)
        assert values["x"] == x.data_ptr() and values["logits"] == logits.data_ptr()
        assert values["valid"] == m
    # The MoE output: a tensor of M rows of its own, the one the kernel wrote.
    got = layer(x, logits, bias)
    assert got.shape == (m, SHAPE.hidden) and got.untyped_storage().nbytes() == got.nbytes
    assert _launched(null, final)["final"] == got.data_ptr()
    full = inputs(SHAPE, final.tokens)
    layer(*full)
    values = _launched(null, final)
    assert values["valid"] == final.tokens and values["x"] == full[0].data_ptr()


def test_the_padding_table_covers_the_padded_variants_alone(null):
    """The bound layer's padding rows (``pad_sources``, [B, B] int64) reach
    the largest bucket of a variant that is padded: with grouped variants
    that take ``valid`` that is the mega kernel's, not the largest bucket
    (2 MiB at 512); an artifact whose grouped variants predate ``valid``
    needs them to its largest (``test_an_artifact_without_valid_still_pads``)."""
    layer = null.layer()
    mega = max(v.tokens for v in layer.artifact.variants if v.kernel == "mega")
    assert max(v.tokens for v in layer.artifact.variants) > mega
    assert tuple(layer._sources.shape) == (mega, mega)


def test_an_artifact_without_valid_still_pads(null):
    """A grouped build from before ``valid`` (its params lack it) reads the
    bucket's rows: a call below the bucket gets a padded copy of x and
    logits, whose rows past M repeat row M - 1, and a chunk of M rows is
    not launched straight into a caller's output (``launch_rows`` answers
    False: such a kernel writes all its bucket's rows). Its padding table
    reaches its largest bucket, every variant being padded."""
    old = tuple(
        dataclasses.replace(v, params=tuple(p for p in v.params if p[0] != VALID))
        for v in variants(SHAPE)
    )
    layer = cpu_layer(SHAPE, old)
    try:
        largest = max(v.tokens for v in old)
        assert tuple(layer._sources.shape) == (largest, largest)
        m = 5
        x, logits, bias = inputs(SHAPE, m)
        variant = layer._variant(layer.tables["float32"][m], "float32")
        assert variant.tokens == 8 and not takes_valid(variant)
        layer(x, logits, bias)
        values = _launched(null, variant)
        assert values["x"] != x.data_ptr() and values["logits"] != logits.data_ptr()
        rows = layer._pad[(m, variant.tokens)]
        assert rows.tolist() == [0, 1, 2, 3, 4, 4, 4, 4]
        out = torch.empty(m, SHAPE.hidden, dtype=torch.bfloat16)
        launches = null.launches
        assert not layer.launch_rows(x, logits, bias, out, [0], m)
        assert layer.launch_rows(*inputs(SHAPE, 8), torch.empty(8, SHAPE.hidden).bfloat16(),
                                 [0], 8)  # its own bucket: straight in  # fmt: skip
        assert null.launches == launches + 1
    finally:
        layer.artifact.close()


def test_padding_repeats_the_last_row():
    g = seeding.generator()
    for m, bucket in ((1, 1), (1, 4), (5, 8), (13, 16), (63, 64)):
        t = torch.randn(m, 7, generator=g)
        want = torch.cat([t, t[-1:].expand(bucket - m, 7)])
        assert torch.equal(pad_rows(t, bucket), want)
        assert torch.equal(pad_rows(t, bucket, pad_sources(64)[m - 1, :bucket]), want)
    full = torch.randn(8, 7, generator=g)
    assert pad_rows(full, 8) is full


def test_row_launches_address_the_callers_rows(tmp_path, fake, weights):
    """``launch_rows`` (the full chunks of a call above the largest bucket):
    one launch per start, in the order given, each launching what a scratch
    call on that start's rows launches, with x, logits and final at those
    rows of the caller's tensors and no other slot moved; a chunk below the
    bucket launches the same way with ``valid`` = its rows (the kernel
    reads and writes those rows alone); a start whose chunk would pass the
    call's rows is refused before anything launches."""
    layer = _layer(tmp_path, fake, weights)
    fake.make_current(0)
    v = layer.variants["grouped-sm_90a-m8-float32-final"]
    m, h, e = 24, SHAPE.hidden, SHAPE.experts
    x = move(torch.zeros(m, h, dtype=torch.bfloat16), 0)
    logits = move(torch.zeros(m, e), 0)
    bias = move(torch.zeros(e), 0)
    out = move(torch.zeros(m, h, dtype=torch.bfloat16), 0)
    final = move(torch.zeros(8, h, dtype=torch.bfloat16), 0)
    layer._launch(v, x, logits, bias, _Block(None, final), scratch=True)
    want = fake.launches[-1][3]
    starts = [0, 16, 8]
    assert layer.launch_rows(x, logits, bias, out, starts, 8)
    launched = fake.launches[-3:]
    for s, (function, _, context, values) in zip(starts, launched, strict=True):
        assert function == ("function", v.entry, 0) and context == 0
        rows = {"x": x.data_ptr() + s * h * 2, "logits": logits.data_ptr() + s * e * 4,
                "final": out.data_ptr() + s * h * 2, "valid": 8}  # fmt: skip
        assert values == {**want, **rows}, s
    assert layer.launch_rows(x, logits, bias, out, [16], 5)  # grouped m8, 5 rows
    rows = {"x": x.data_ptr() + 16 * h * 2, "logits": logits.data_ptr() + 16 * e * 4,
            "final": out.data_ptr() + 16 * h * 2, "valid": 5}  # fmt: skip
    assert fake.launches[-1][3] == {**want, **rows}
    count = len(fake.launches)
    with pytest.raises(ValueError, match="past the call's rows"):
        layer.launch_rows(x, logits, bias, out, [0, 20], 8)  # rows 20..27 of 24
    with pytest.raises(ValueError, match="past the call's rows"):
        layer.launch_rows(x, logits, bias, out, [20], 5)  # rows 20..24 of 24
    assert len(fake.launches) == count


# Capture and context ----------------------------------------------------------------------


@pytest.mark.parametrize("current", [0, 1, None])
def test_captured_launches_hold_the_layer(tmp_path, fake, weights, current):
    """Layer on device 0, the thread's current context device ``current``
    (torch's current device: the same, 0 with none). Not capturing: no hold,
    and the driver is asked only when torch's device is another (torch's
    answer concerns another stream then). Capturing the layer's stream: the
    graph holds the layer, whatever device is current; capturing only
    device 1's stream holds nothing."""
    layer = _layer(tmp_path, fake, weights)
    if current is not None:
        fake.make_current(current)
    v = layer.variants["mega-sm_90a-m1-float32"]
    stream = fake.current_stream(0)
    layer._launch(v, *launch_args(layer, v, 0))
    asked = fake.torch_device() != 0
    assert fake.queries == ([stream] if asked else []) and fake.graph_objects == {}
    fake.capturing[fake.current_stream(1)] = "other-graph"
    layer._launch(v, *launch_args(layer, v, 0))
    assert fake.graph_objects == {}
    fake.capturing[stream] = "graph"
    layer._launch(v, *launch_args(layer, v, 0))
    assert fake.queries[-1] == stream
    assert len(fake.graph_objects["graph"]) == 1
    assert graphs.holding(lambda owner: owner is layer) == 1
    fake.capturing.clear()
    fake.destroy_graph("graph")
    assert graphs.release() == 1


@pytest.mark.parametrize("current", [0, 1, None])
def test_the_context_is_pushed_only_when_not_current(tmp_path, fake, weights, current):
    layer = _layer(tmp_path, fake, weights)
    if current is not None:
        fake.make_current(current)
    v = layer.variants["grouped-sm_90a-m8-float32-final"]
    pushes = fake.pushes
    layer._launch(v, *launch_args(layer, v, 0))
    assert fake.launches[-1][2] == 0, "launched outside the layer's context"
    assert fake.current() == current, "the thread's current context moved"
    assert fake.pushes - pushes == (0 if current == 0 else 1)


# Input checks ----------------------------------------------------------------------------


def _misaligned(t):
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t)


def _strided(t):
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    return wide[..., ::2].copy_(t)


FAULTS = {
    "dtype": lambda t: t.to(torch.float16), "shape": lambda t: t[..., :-1],
    "device": lambda t: move(t, 0), "strides": _strided, "alignment": _misaligned,
    "type": lambda t: t.tolist(), "rank": lambda t: t[None],
}  # fmt: skip


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("which", ["x", "logits", "bias"])
def test_checks_after_an_accepted_call_refuse_as_before(which, fault, monkeypatch):
    """A call accepted once (its dtype names cached) does not make a bad one
    pass: each fault of each tensor raises, with the message the checks give
    without that cache."""
    g = seeding.generator()
    good = {"x": torch.randn(3, SHAPE.hidden, generator=g).to(torch.bfloat16),
            "logits": torch.randn(3, SHAPE.experts, generator=g),
            "bias": torch.randn(SHAPE.experts, generator=g)}  # fmt: skip
    bad = {**good, which: FAULTS[fault](good[which])}
    monkeypatch.setattr(runtime.inputs, "_ACCEPTED", {})
    with pytest.raises(InputError) as cold:
        check_call(*bad.values(), SHAPE, CPU, BOTH)
    assert check_call(*good.values(), SHAPE, CPU, BOTH) == 3
    assert runtime.inputs._ACCEPTED, "an accepted call cached nothing"
    with pytest.raises(InputError) as warm:
        check_call(*bad.values(), SHAPE, CPU, BOTH)
    assert str(warm.value) == str(cold.value)
    for m in (0, MAX_TOKENS + 1):  # M out of range, after the cache too
        x, logits = (good[n][:1].expand(m, -1).contiguous() for n in ("x", "logits"))
        with pytest.raises(InputError, match=rf"in 1..{MAX_TOKENS}, found {m}"):
            check_call(x, logits, good["bias"], SHAPE, CPU, BOTH)


def test_a_model_without_bias_or_shared_expert_launches_the_routed_abi(null):
    """A softmax model without a bias or a shared expert (Qwen3): the layer
    binds its routed-only variants, takes bias None and launches 0 in the
    bias slot (the kernels never read it), writes the MoE output where it
    returns it, and gives no shared rows."""
    import dataclasses

    from benchmarks.host_path import cpu_layer
    from benchmarks.host_path import variants as shape_variants

    shape = dataclasses.replace(SHAPE, shared_experts=0, bias=False, score="softmax")
    layer = cpu_layer(shape, shape_variants(shape))
    try:
        for m in (1, 3, 8, 13):
            x, logits, bias = inputs(shape, m)
            assert bias is None
            y = layer(x, logits, None)
            variant = layer._variant(layer.tables["float32"][m], "float32")
            values = _launched(null, variant)
            assert "s13_scale" not in values and "shared_out" not in values, variant.name
            assert values["bias"] == 0 and values["final"] == y.data_ptr()
            assert values["x"] == x.data_ptr() or m != variant.tokens
        *_, shared = layer.grouped(*inputs(shape, 8)[:2], None)
        assert shared is None
        with pytest.raises(InputError, match="pass None"):
            layer(*inputs(SHAPE, 2))
    finally:
        layer.artifact.close()

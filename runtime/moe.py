"""A bound MoE layer: the kernels' calling conventions (docs/semantics.md) over prebuilt cubins.

``layer.mega(x, logits, bias)`` -> (out, ids, weights) (``shared=True``: also
the shared expert's output) and ``layer.grouped(x, logits, bias,
finalize=False)`` -> (out, ids, weights, shared) or ``final`` run one kernel;
``layer(x, logits, bias)`` serves any M >= 0 and returns the full MoE
output BF16 [M, H] (routed, weighted, plus the shared expert). Shapes: out BF16 [M * top_k, H] (row t*top_k + k = route k of
token t, unweighted), ids int32 [M, top_k], weights FP32 [M, top_k], shared
and final BF16 [M, H]. Padded rows never come back.

Each call validates its tensors, then launches on torch's current stream of
the layer's device. A launch allocates one block of bytes from torch's
caching allocator for all its outputs (``OutputLayout``: each output a view
at an OUTPUT_ALIGN-byte offset), or, for a call that returns only the MoE
output of a variant that writes it (``layer(...)``, ``grouped(...,
finalize=True)``), only ``final``, the other outputs going to a scratch
buffer of the stream's (``Workspaces.scratch``: the kernel writes and reads
them itself); and, when M is not a bucket and the variant does not take
``valid`` (the mega kernel, grouped builds from before it), the padded
inputs (one gather each, ``runtime.plan.pad_rows``); workspaces are made on a
stream's first call, outside any capture. So a layer can be captured in a
CUDA graph and replayed. A captured launch makes the graph hold the layer
(runtime.graphs): the graph may be replayed after the caller dropped every
reference to the layer and its artifact; what it points at is freed only
once the graph and its instantiations are destroyed. The outputs of a call
share its block, except the MoE output ``final`` of a variant that writes it,
which is an allocation of its own: ``layer(...)`` returns a tensor that
keeps only itself allocated, while any one of ``mega``'s or ``grouped``'s
outputs the caller keeps keeps the whole block (at glm5's M = 64 about 4.5
MiB, most of it the routes' rows).

The eager host path (docs/notes/host-path.md): per (variant, stream, and
whether the outputs go to the scratch) a ``CallPlan`` holds the parameter
block filled once with every value that does not change between calls (the
weights' and row tables' addresses, the tensor maps, the stream's workspaces
and scratch, i32 scalars); a call writes only the addresses of x, logits,
bias and its output block (or ``final``), and ``valid``. The driver's capture
query runs only when ``runtime.graphs.capture_possible`` cannot rule a
capture out, and the device's context is pushed only when it is not current
already.

Calls the mega kernel serves: the mega variants of a model with a shared
expert compute it in extra routes of the same launch (a ``shared_out``
parameter); the layer refuses, at bind, mega variants built without it, so
no call runs an expert in torch. A mega variant with a ``final`` parameter
also writes the MoE output itself (its last-arriving CTAs sum each token's
rows, ``kernels/mega_common.finish_slice``), as the grouped kernel's
finalize does: ``layer(...)`` is then one launch. For variants without it
(artifacts built before) the layer weights and adds the routes and the
shared row in torch (``combine``: FP32, four small kernels, no host sync;
~12.5 us on the H200 in a CUDA graph).
"""

from __future__ import annotations

import math
import threading

import torch

from runtime import driver, graphs
from runtime.chunks import run_chunked
from runtime.constants import KERNELS, TILE, VALID
from runtime.errors import ArtifactError, InputError
from runtime.inputs import LOGITS, LOGITS_NAMES, check_call
from runtime.launch import Parameters
from runtime.layout import logical_rows
from runtime.model import MoEShape
from runtime.plan import Step, bucket_for, default_table, pad_rows, pad_sources

#: i32 parameters the runtime knows how to fill, from (bucket, top_k).
SCALARS = {"tokens": lambda m, k: m, "routes": lambda m, k: m * k}
#: Pointer parameters whose values change with every call: the caller's
#: inputs (padded to the bucket, or M rows with ``VALID``) ...
INPUTS = ("x", "logits", "bias")
#: ... and the outputs, views of the call's block (``OutputLayout``).
OUTPUTS = ("out", "ids", "weights", "shared_out", "final")
#: Byte alignment of each output in a call's block: what ``cudaMalloc`` gives
#: a fresh allocation, so each output starts as a tensor of its own would
#: (the kernels need ``runtime.inputs.ALIGN``, 16).
OUTPUT_ALIGN = 256
#: The byte ``poison`` fills a block with: NaN in BF16 and FP32, -1 in int32.
POISON_BYTE = 0xFF
#: torch's raw current-stream getter (what ``torch.cuda.current_stream(d)
#: .cuda_stream`` returns, without making a Stream object); None in a build
#: without CUDA.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(ordinal: int) -> int:
    """torch's current stream of CUDA device ``ordinal``, a raw CUstream handle."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(ordinal)
    return torch.cuda.current_stream(ordinal).cuda_stream


class MoELayer:
    """One weight set bound to one device (see module docstring).

    ``table``: M -> Step, per logits dtype name, overriding the default
    dispatch (``runtime.plan.default_table``). ``poison``: fill every output
    with NaN (ids with -1) before each launch, so unwritten elements show (a
    test aid; it adds one fill per call). ``layouts``: variant name -> its
    ``OutputLayout``. The bound tensors' addresses are read once per
    (variant, stream, scratch or not) (``CallPlan``); they are fixed at bind already (the
    tensor maps encode the weights' addresses)."""

    def __init__(self, artifact, tensors: dict, shape: MoEShape, device: torch.device,
                 table: dict | None = None, poison: bool = False):  # fmt: skip
        self.artifact, self.shape, self.device = artifact, shape, device
        self.ordinal = device.index
        self.tensors = tensors
        self.poison = poison
        self.launchers = {v.name: artifact.launcher(v, self.ordinal) for v in artifact.variants}
        self.variants = {v.name: v for v in artifact.variants}
        #: Variants that write the MoE output ``final`` themselves (``writes_final``).
        self.final_writers = {v.name for v in artifact.variants if writes_final(v)}
        #: Variants that read only a call's rows (``VALID``): no padded copy.
        self.unpadded = {v.name for v in artifact.variants if takes_valid(v)}
        self.maps = {}
        for v in artifact.variants:
            if v.tensor_maps not in self.maps:
                self.maps[v.tensor_maps] = artifact.tensor_maps(tensors, v.tensor_maps, device)
        self.rows = {
            "rows1": logical_rows(2 * shape.inter, device),
            "rows2": logical_rows(shape.hidden, device),
            "rows": logical_rows(TILE, device),
        }
        # (kernel, dtype) -> {bucket: {finalize: variant}}
        self.buckets: dict[tuple[str, str], dict[int, dict[bool, object]]] = {}
        for v in artifact.variants:
            slot = self.buckets.setdefault((v.kernel, v.logits_dtype), {})
            slot.setdefault(v.tokens, {})[v.finalize] = v
        self.tables = {}
        for dtype in LOGITS:
            kernels = {k: {b: set(f) for b, f in self.buckets.get((k, dtype), {}).items()}
                       for k in KERNELS}  # fmt: skip
            self.tables[dtype] = dict(table.get(dtype, {})) if table else default_table(kernels)
        self.dtypes = tuple(d for d in LOGITS if self.tables[d])
        #: The largest M one launch serves (any dtype); above it, chunks.
        self.largest = max((max(t) for t in self.tables.values() if t), default=0)
        for dtype, steps in self.tables.items():
            for m, step in steps.items():
                found = self.buckets.get((step.kernel, dtype), {}).get(step.bucket, {})
                if step.finalize not in found or not 1 <= m <= step.bucket:
                    raise InputError(
                        f"table[{dtype!r}][{m}]: {step} names no variant of this artifact "
                        f"that serves M = {m}"
                    )
        if shape.shared_experts:
            routed_only = [v.name for v in artifact.variants
                           if v.kernel == "mega" and not computes_shared(v)]  # fmt: skip
            if routed_only:
                raise ArtifactError(
                    f"variants {', '.join(routed_only)}: built without the shared expert's "
                    "routes (no shared_out parameter), but the model has a shared expert; "
                    "rebuild the artifact"
                )
        self.layouts = {
            v.name: OutputLayout(v.tokens, shape.top_k, shape.hidden, v.name in self.final_writers)
            for v in artifact.variants
        }
        #: Logits dtype names each kernel's variants serve.
        self._kernel_dtypes = {
            k: tuple(d for d in LOGITS if (k, d) in self.buckets) for k in KERNELS
        }
        #: (variant name, stream, whether its outputs but ``final`` go to the
        #: stream's scratch) -> CallPlan.
        self._plans: dict[tuple[str, int, bool], CallPlan] = {}
        #: Bytes of the per-stream scratch a call that returns only ``final``
        #: writes its other outputs to (``Workspaces.scratch``): the largest
        #: final-writing variant's block.
        self._scratch_bytes = max(
            (self.layouts[name].nbytes for name in self.final_writers), default=0
        )
        #: Padding row indices (runtime.plan.pad_sources) up to the largest
        #: bucket of a variant that is padded (one that does not take
        #: ``valid``: the mega kernel's 1..4, every bucket of an artifact
        #: built before it; a [B, B] int64 table, 2 MiB at B = 512), and
        #: (M, bucket) -> the row of it that pads M rows.
        padded = [v.tokens for v in artifact.variants if v.name not in self.unpadded]
        self._sources = pad_sources(max(padded, default=1), device)
        self._pad: dict[tuple[int, int], torch.Tensor] = {}
        # The row tables and padding indices were made on the current stream;
        # a first call on another stream must not read them half-written.
        if torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(device).synchronize()

    # Entries ------------------------------------------------------------------

    def mega(self, x, logits, bias, shared: bool = False):
        """Routed experts by the mega kernel: (out, ids, weights); with
        ``shared`` also the shared expert's BF16 [M, H] output (computed by
        the same launch; None without a shared expert)."""
        m, dtype = self._check(x, logits, bias, "mega")
        variant = self._variant(self._step("mega", m, dtype, False), dtype)
        block, layout = self._run(variant, x, logits, bias, m)
        routed = self._crop(layout, block, m)
        if not shared:
            return routed
        rows = layout.view(block, "shared_out", m) if self.shape.shared_experts else None
        return (*routed, rows)

    def grouped(self, x, logits, bias, finalize: bool = False):
        """Routed plus shared expert by the grouped kernel: (out, ids, weights,
        shared) (``shared`` None without a shared expert), or with
        ``finalize`` the BF16 [M, H] MoE output."""
        m, dtype = self._check(x, logits, bias, "grouped")
        variant = self._variant(self._step("grouped", m, dtype, finalize), dtype)
        block, layout = self._run(variant, x, logits, bias, m, final_only=finalize)
        if finalize:
            return layout.view(block, "final", m)
        shared = layout.view(block, "shared_out", m) if self.shape.shared_experts else None
        return (*self._crop(layout, block, m), shared)

    def __call__(self, x, logits, bias):
        """The MoE layer's output BF16 [M, H] for any M >= 0: one launch up to
        the largest bucket, bucket-sized chunks above it
        (``runtime.chunks.run_chunked``: no host sync, graph-capturable; each
        chunk re-reads the experts its tokens need). M = 0 (an empty batch):
        checked as any call, an empty [0, H] output, no launch."""
        rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
        if rows > self.largest or rows == 0:
            return run_chunked(self, x, logits, bias)
        m, dtype = self._check(x, logits, bias, None)
        step = self.tables[dtype].get(m)
        if step is None:
            raise InputError(f"no {dtype}-logits variant of this artifact serves M = {m}")
        variant = self._variant(step, dtype)
        block, layout = self._run(variant, x, logits, bias, m, final_only=True)
        if variant.name in self.final_writers:
            return layout.view(block, "final", m)
        out, ids, weights = self._crop(layout, block, m)
        shared = layout.view(block, "shared_out", m) if self.shape.shared_experts else None
        return combine(out, weights, shared)

    # Parts ----------------------------------------------------------------------

    def _check(self, x, logits, bias, kernel):
        dtypes = self.dtypes
        if kernel is not None:
            dtypes = self._kernel_dtypes[kernel]
            if not dtypes:
                raise InputError(f"this artifact has no {kernel} variant for {self.artifact.arch}")
        m = check_call(x, logits, bias, self.shape, self.device, dtypes)
        return m, LOGITS_NAMES[logits.dtype]

    def _step(self, kernel: str, m: int, dtype: str, finalize: bool) -> Step:
        by_bucket = self.buckets.get((kernel, dtype), {})
        served = {b for b, f in by_bucket.items() if finalize in f}
        bucket = bucket_for(m, served)
        if bucket is None:
            raise InputError(
                f"{kernel} (logits {dtype}, finalize {finalize}): no bucket serves M = {m} "
                f"(compiled: {sorted(served)})"
            )
        return Step(kernel, bucket, finalize)

    def _variant(self, step: Step, dtype: str):
        return self.buckets[(step.kernel, dtype)][step.bucket][step.finalize]

    def _run(self, variant, x, logits, bias, m: int, final_only: bool = False):
        """Pads x and logits (M rows) to ``variant``'s bucket, unless the
        variant reads only the call's rows (``unpadded``: it takes ``valid``
        = M, and its tokens past M repeat row M - 1 as padding would),
        allocates the call's output block (and ``final``, when the variant
        writes it: M rows where it takes ``valid``) and launches; returns (block, its layout); ``layout.view(block, "final")``
        then gives ``final``. ``final_only``: the caller returns only
        ``final``; a variant that writes it then gets only ``final`` as a
        tensor of the call, its other outputs going to the stream's scratch
        (one allocation a call instead of two; not with ``poison``, whose
        fills check every output)."""
        bucket = variant.tokens
        unpadded = m != bucket and variant.name in self.unpadded
        if m != bucket and not unpadded:
            source = self._pad.get((m, bucket))
            if source is None:  # a view of the table made at bind: no device work
                source = self._pad[(m, bucket)] = self._sources[m - 1, :bucket]
            x, logits = pad_rows(x, bucket, source), pad_rows(logits, bucket, source)
        layout = self.layouts[variant.name]
        scratch = final_only and not self.poison and variant.name in self.final_writers
        if scratch:
            # A variant that takes ``valid`` writes only the call's rows of final.
            block = layout.allocate_final(self.device, m if unpadded else None)
        else:
            block = layout.allocate(self.device)
            if self.poison:
                block.fill_(POISON_BYTE)
        self._launch(variant, x, logits, bias, block, scratch)
        return block, layout

    def _launch(self, variant, x, logits, bias, block, scratch: bool = False,
                rows=None) -> None:  # fmt: skip
        """Launches ``variant`` on torch's current stream of the layer's
        device: ``x`` and ``logits`` at the bucket's rows (M rows where the
        variant takes ``valid``), ``block`` the
        call's output block (``self.layouts[variant.name]``; with ``scratch``
        only its ``final``, the other outputs going to the stream's scratch);
        with ``rows`` (``_launch_rows``), one launch per chunk (``_issue``)."""
        graphs.release()
        stream = current_stream(self.ordinal)
        plan = self._plan(variant, stream, scratch)
        capturing = graphs.capture_possible(self.ordinal)
        # The device's context is current for the launch (the legacy default
        # stream, handle 0, runs in the current context). Pushing it only when
        # it is not current already, and popping it after, leaves the thread's
        # current context as it was: leaving another current would move
        # torch's current device to this layer's (the CUDA runtime takes the
        # thread's current context as its device).
        if driver.context_is_current(self.ordinal):
            self._issue(plan, stream, capturing, x, logits, bias, block, rows)
        else:
            with driver.context(self.ordinal):
                self._issue(plan, stream, capturing, x, logits, bias, block, rows)

    def _issue(self, plan, stream: int, capturing: bool, x, logits, bias, block,
               rows=None) -> None:  # fmt: skip
        """One launch of ``plan`` (``rows`` None: ``x``, ``logits``, ``bias``
        and the output ``block``), or with ``rows`` = (starts, row bytes of x,
        logits and the output, the rows of a chunk) one launch per start at
        those rows of x, logits and the output tensor ``block``; with
        ``capturing``, the layer held by the graph being captured first."""
        if capturing:
            # A graph being captured keeps this layer (weights, rows, maps,
            # the artifact's workspaces and libraries) alive: runtime.graphs.
            graphs.hold(stream, self)
        if rows is None:
            plan.launch(stream, x, logits, bias, block)
            return
        starts, row_x, row_logits, row_out, count = rows
        x0, logits0, out0 = x.data_ptr(), logits.data_ptr(), block.data_ptr()
        b = 0 if bias is None else bias.data_ptr()
        for s in starts:
            plan.launch_at(stream, (x0 + s * row_x, logits0 + s * row_logits, b), 0,
                           out0 + s * row_out, count)  # fmt: skip

    def launch_rows(self, x, logits, bias, out, starts, rows: int) -> bool:
        """For row chunks (``runtime.chunks.run_chunked``): launches, for each
        start s of ``starts``, the variant that serves ``rows`` tokens on
        rows s .. s + rows - 1 of ``x`` and ``logits``, its ``final`` written
        straight into the same rows of ``out`` (dense BF16 [M, H]; every
        chunk's other outputs go to the stream's scratch): a variant at its
        own bucket, or one that takes ``valid`` (``valid`` = rows: it reads
        and writes those rows alone, its tokens past them repeating the
        last). No views, no copies: addresses offset by whole rows, so each
        launch reads and writes the caller's dense rows as a call on row
        slices would. Returns False, launching nothing, where no
        final-writing variant serves ``rows`` so; the caller then takes the
        layer call per chunk. The caller has checked the whole call (dtypes,
        shapes, device, density, alignment: ``run_chunked`` says when row
        offsets keep it)."""
        dtype = LOGITS_NAMES[logits.dtype]
        step = self.tables[dtype].get(rows)
        if step is None:
            return False
        variant = self._variant(step, dtype)
        if variant.name not in self.final_writers:
            return False
        if step.bucket != rows and variant.name not in self.unpadded:
            return False
        self._launch_rows(variant, x, logits, bias, out, starts, rows)
        return True

    def _launch_rows(self, variant, x, logits, bias, out, starts, rows: int) -> None:
        """``launch_rows``'s launches of ``variant``, ``rows`` a chunk: one
        host path (``_launch``: stream, plan, capture check, context), then
        one ``CallPlan.launch_at`` per start (``_issue``)."""
        if any(s < 0 or s + rows > min(x.shape[0], out.shape[0]) for s in starts):
            raise ValueError(f"starts {list(starts)}: a chunk of {rows} rows past the call's rows")
        steps = (list(starts), x.stride(0) * x.element_size(),
                 logits.stride(0) * logits.element_size(), out.stride(0) * out.element_size(),
                 rows)  # fmt: skip
        self._launch(variant, x, logits, bias, out, True, steps)

    def _plan(self, variant, stream: int, scratch: bool = False) -> CallPlan:
        """``variant``'s plan on ``stream`` (with ``scratch``: its outputs but
        ``final`` in the stream's scratch): made on its first call there, and
        made again when the stream's workspaces were made again (after
        ``Artifact.close``, a plan would hold freed addresses)."""
        spaces = self.artifact.workspaces(self.ordinal)
        workspace = spaces.pointers(stream, variant)
        key = (variant.name, stream, scratch)
        plan = self._plans.get(key)
        if plan is None or plan.workspace is not workspace:
            fixed = {name: t.data_ptr() for name, t in {**self.tensors, **self.rows}.items()}
            fixed["maps"] = self.maps[variant.tensor_maps].data_ptr()
            base = spaces.scratch(stream, self._scratch_bytes) if scratch else None
            plan = CallPlan(variant, self.launchers[variant.name], fixed, workspace,
                            self.layouts[variant.name], self.shape.top_k, base)  # fmt: skip
            self._plans[key] = plan
        return plan

    def _crop(self, layout, block, m: int):
        """(out, ids, weights) of the first ``m`` tokens."""
        return (layout.view(block, "out", m * self.shape.top_k), layout.view(block, "ids", m),
                layout.view(block, "weights", m))  # fmt: skip


class OutputLayout:
    """Where a variant's outputs lie in a call's block of bytes (uint8
    [``nbytes``], storage offset 0): ``fields`` maps each name of OUTPUTS but
    ``final`` to (byte offset, dtype, shape at the bucket), in that order,
    each offset a multiple of OUTPUT_ALIGN and no two overlapping. ``final``:
    with ``separate_final`` (the variant writes it) a BF16 [B, H] tensor of
    its own (``_Block.final``; [M, H] from ``allocate_final(device, M)``),
    else ``shared_out``'s field (the grouped
    kernel without finalize gets one pointer for both). Shapes: out BF16
    [B * top_k, H], ids int32 [B, top_k], weights FP32 [B, top_k],
    shared_out and final BF16 [B, H], B the bucket."""

    def __init__(self, bucket: int, top_k: int, hidden: int, separate_final: bool):
        b, k, h = bucket, top_k, hidden
        self.separate_final, self.final_shape = separate_final, (b, h)
        self._templates: dict[tuple, torch.Tensor] = {}  # allocate_final's
        fields = [("out", torch.bfloat16, (b * k, h)), ("ids", torch.int32, (b, k)),
                  ("weights", torch.float32, (b, k)), ("shared_out", torch.bfloat16, (b, h))]  # fmt: skip
        self.fields: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in fields:
            self.fields[name] = (offset, dtype, shape)
            offset += -(-math.prod(shape) * dtype.itemsize // OUTPUT_ALIGN) * OUTPUT_ALIGN
        self.nbytes = offset
        if not separate_final:
            self.fields["final"] = self.fields["shared_out"]
        #: Output name -> byte offset in the block.
        self.offsets = {name: field[0] for name, field in self.fields.items()}
        # name -> (dtype, rows, row width, offset in elements): the views' terms.
        self._views = {
            name: (dtype, shape[0], shape[1], offset // dtype.itemsize)
            for name, (offset, dtype, shape) in self.fields.items()
        }

    def allocate_final(self, device, rows: int | None = None) -> _Block:
        """Only ``final`` of a call (``separate_final``; the other outputs
        live elsewhere: ``CallPlan``'s ``scratch``), at the bucket's rows or
        ``rows`` (a variant that takes ``valid`` writes only those):
        ``torch.empty_like`` of a template made once per (device, rows) (one
        element expanded to that shape, so it holds no memory), a fresh
        contiguous tensor like ``torch.empty``'s, with fewer arguments to
        parse at every call."""
        assert self.separate_final
        template = self._templates.get((device, rows))
        if template is None:
            one = torch.empty((1, 1), dtype=torch.bfloat16, device=device)
            shape = self.final_shape if rows is None else (rows, self.final_shape[1])
            template = self._templates[(device, rows)] = one.expand(shape)
        return _Block(None, torch.empty_like(template))

    def allocate(self, device, empty=torch.empty):
        """A call's outputs on ``device``: the block of bytes, or with
        ``separate_final`` a ``_Block`` of it and ``final`` (``empty``:
        torch.empty's signature, for stand-ins)."""
        block = empty(self.nbytes, dtype=torch.uint8, device=device)
        if not self.separate_final:
            return block
        return _Block(block, empty(self.final_shape, dtype=torch.bfloat16, device=device))

    def view(self, block, name: str, rows: int | None = None) -> torch.Tensor:
        """Output ``name`` of a call (``block``: its bytes, or a ``_Block``):
        a dense view of its first ``rows`` rows (default: all of the
        bucket's, or for ``final`` all of its own)."""
        if name == "final" and self.separate_final:
            # The whole tensor at its rows (the bucket's, or a call's own:
            # ``allocate_final``): a slice costs a view.
            whole = rows is None or rows == block.final.shape[0]
            return block.final if whole else block.final[:rows]
        dtype, bucket_rows, width, start = self._views[name]
        shape = (bucket_rows if rows is None else rows, width)
        data = block.bytes if isinstance(block, _Block) else block
        return data.view(dtype).as_strided(shape, (width, 1), start)


class _Block:
    """A call's outputs when ``final`` is allocated apart: ``bytes`` the
    block (``OutputLayout``; None when the other outputs go to a stream's
    scratch), ``final`` BF16 [B, H] (or [M, H]: ``allocate_final``)."""

    __slots__ = ("bytes", "final")

    def __init__(self, block: torch.Tensor, final: torch.Tensor):
        self.bytes, self.final = block, final

    def fill_(self, value: int) -> None:
        self.bytes.fill_(value)
        self.final.view(torch.uint8).fill_(value)

    def data_ptr(self) -> int:
        return self.bytes.data_ptr()


class CallPlan:
    """One variant's launches on one stream for one layer.

    ``parameters`` is filled at construction with every value that does not
    change between calls: i32 scalars (``SCALARS``), the stream's
    ``workspace`` pointers, and ``fixed`` (parameter name -> address: weights,
    row tables, tensor maps), in that order of precedence after the per-call
    names, as a fill by name would. ``inputs``: (slot, index into INPUTS),
    ``outputs``: (slot, byte offset in the block), the slots ``launch``
    writes; ``valid_slot``: the slot of ``VALID`` (None without it), which
    every launch writes (the call's rows, the bucket's by default).
    ``scratch``: an address holding a block of ``layout``, where the
    outputs but ``final`` go at every call (fixed slots; ``launch`` then
    writes only the inputs' and ``final``'s). ``launch`` writes and launches
    under a lock, so threads sharing a plan (one layer, one stream) never
    launch each other's addresses; the driver copies the values at the
    launch (a captured graph node keeps its own copy)."""

    def __init__(self, variant, launcher, fixed: dict, workspace: dict, layout: OutputLayout,
                 top_k: int, scratch: int | None = None):  # fmt: skip
        self.variant, self.launcher, self.workspace = variant, launcher, workspace
        self.parameters = Parameters(kind for _, kind in variant.params)
        #: The slot of ``final`` when it is a tensor of its own, else None.
        self.final_slot = None
        inputs, outputs = [], []
        #: The slot of ``valid`` (the call's rows) when the variant takes it.
        self.valid_slot = None
        for i, (name, kind) in enumerate(variant.params):
            if name == VALID and kind == "i32":
                self.valid_slot = i
                self.parameters.slot(i, variant.tokens)
            elif kind == "i32":
                self.parameters.slot(i, SCALARS[name](variant.tokens, top_k))
            elif name in workspace:
                self.parameters.slot(i, workspace[name])
            elif name in INPUTS:
                inputs.append((i, INPUTS.index(name)))
            elif name == "final" and layout.separate_final:
                self.final_slot = i
            elif name in layout.offsets and scratch is not None:
                self.parameters.slot(i, scratch + layout.offsets[name])
            elif name in layout.offsets:
                outputs.append((i, layout.offsets[name]))
            else:
                self.parameters.slot(i, fixed[name])
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self._lock = threading.Lock()

    def launch(self, stream: int, x, logits, bias, block) -> None:
        """One call: x, logits, bias (at the bucket's rows, or fewer where
        the plan has a ``valid_slot``: their rows are the call's ``valid``)
        and the output ``block`` of this plan's layout, on ``stream``."""
        # A model without a bias passes None: its kernels never read it.
        addresses = (x.data_ptr(), logits.data_ptr(), 0 if bias is None else bias.data_ptr())
        base = block.data_ptr() if self.outputs else 0
        final = block.final.data_ptr() if self.final_slot is not None else 0
        self.launch_at(stream, addresses, base, final, min(x.shape[0], self.variant.tokens))

    def launch_at(self, stream: int, addresses: tuple, base: int, final: int,
                  valid: int | None = None) -> None:  # fmt: skip
        """One call by addresses: ``addresses`` of x, logits and bias (0 for
        none) in INPUTS order, ``base`` the output block's (read only where
        this plan has output slots), ``final`` the MoE output's (read only
        where ``final`` is a tensor of its own), ``valid`` the rows of x and
        logits (None: the bucket's; written only where the plan has a
        ``valid_slot``)."""
        values = self.parameters.values
        with self._lock:
            if self.valid_slot is not None:
                values[self.valid_slot] = self.variant.tokens if valid is None else valid
            for i, j in self.inputs:
                values[i] = addresses[j]
            for i, offset in self.outputs:
                values[i] = base + offset
            if self.final_slot is not None:
                values[self.final_slot] = final
            self.launcher.launch(stream, self.parameters)


def writes_final(variant) -> bool:
    """Whether ``variant`` writes the MoE output ``final`` itself: a grouped
    variant built with finalize, or a mega variant with a ``final``
    parameter (its last-arriving CTAs sum each token's rows)."""
    if variant.kernel == "mega":
        return any(name == "final" for name, _ in variant.params)
    return variant.finalize


def takes_valid(variant) -> bool:
    """Whether ``variant`` has the i32 parameter ``valid`` (the rows of x and
    logits a call holds): a grouped build since it was added; older
    artifacts and the mega kernel read the bucket's rows."""
    return (VALID, "i32") in ((name, kind) for name, kind in variant.params)


def computes_shared(variant) -> bool:
    """Whether ``variant`` writes the shared expert's rows (``shared_out``)."""
    return any(name == "shared_out" for name, _ in variant.params)


def combine(out, weights, shared):
    """BF16 [M, H] = sum_k weights[t, k] * out[t * top_k + k] (+ shared[t]),
    in FP32, rounded once. ``out`` BF16 [M * top_k, H], ``weights`` FP32
    [M, top_k], ``shared`` BF16 [M, H] or None. Four kernels whatever top_k
    (the sum's order differs from ``runtime.reference.finalize``'s top-k
    order by FP32 ulps only); device ops only, so capture-safe."""
    m, k = weights.shape
    total = (weights[:, :, None] * out.view(m, k, -1)).sum(dim=1)
    if shared is not None:
        total += shared
    return total.to(torch.bfloat16)


def fillable(variant, tensors: dict) -> list[str]:
    """Parameters of ``variant`` the layer cannot fill (should be none)."""
    known = set(tensors) | {"maps", "rows1", "rows2", "rows", *INPUTS, *OUTPUTS}
    known |= {w.name for w in variant.workspace}
    missing = []
    for name, kind in variant.params:
        scalar = name in SCALARS or name == VALID
        if (kind == "i32" and not scalar) or (kind == "pointer" and name not in known):
            missing.append(f"{name} ({kind})")
    return missing

"""A bound MoE layer: the kernels' calling conventions (docs/semantics.md) over prebuilt cubins.

``layer.mega(x, logits, bias)`` -> (out, ids, weights) (``shared=True``: also
the shared expert's output) and ``layer.grouped(x, logits, bias,
finalize=False)`` -> (out, ids, weights, shared) or ``final`` run one kernel;
``layer(x, logits, bias)`` serves any M >= 1 and returns the full MoE
output BF16 [M, H] (routed, weighted, plus the shared expert). Shapes: out BF16 [M * top_k, H] (row t*top_k + k = route k of
token t, unweighted), ids int32 [M, top_k], weights FP32 [M, top_k], shared
and final BF16 [M, H]. Padded rows never come back.

Each call validates its tensors, then launches on torch's current stream of
the layer's device. Launches allocate only their outputs (torch's caching
allocator) and the padded inputs when M is not a bucket; workspaces are made
on a stream's first call, outside any capture. So a layer can be captured in
a CUDA graph and replayed. A captured launch makes the graph hold the layer
(runtime.graphs): the graph may be replayed after the caller dropped every
reference to the layer and its artifact; what it points at is freed only
once the graph and its instantiations are destroyed.

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

import torch

from runtime import driver, graphs
from runtime.chunks import run_chunked
from runtime.constants import KERNELS, TILE
from runtime.errors import ArtifactError, InputError
from runtime.inputs import LOGITS, check_call
from runtime.layout import logical_rows
from runtime.model import MoEShape
from runtime.plan import Step, bucket_for, default_table, pad_rows

_DTYPE_NAMES = {v: k for k, v in LOGITS.items()}
#: i32 parameters the runtime knows how to fill, from (bucket, top_k).
SCALARS = {"tokens": lambda m, k: m, "routes": lambda m, k: m * k}


class MoELayer:
    """One weight set bound to one device (see module docstring).

    ``table``: M -> Step, per logits dtype name, overriding the default
    dispatch (``runtime.plan.default_table``). ``poison``: fill every output
    with NaN (ids with -1) before each launch, so unwritten elements show (a
    test aid; it adds one fill per output)."""

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

    # Entries ------------------------------------------------------------------

    def mega(self, x, logits, bias, shared: bool = False):
        """Routed experts by the mega kernel: (out, ids, weights); with
        ``shared`` also the shared expert's BF16 [M, H] output (computed by
        the same launch; None without a shared expert)."""
        m, dtype = self._check(x, logits, bias, "mega")
        step = self._step("mega", m, dtype, False)
        out, ids, weights, rows, _ = self._run(step, x, logits, bias, dtype)
        routed = self._crop(m, out, ids, weights)
        if not shared:
            return routed
        return (*routed, rows[:m] if self.shape.shared_experts else None)

    def grouped(self, x, logits, bias, finalize: bool = False):
        """Routed plus shared expert by the grouped kernel: (out, ids, weights,
        shared), or with ``finalize`` the BF16 [M, H] MoE output."""
        m, dtype = self._check(x, logits, bias, "grouped")
        step = self._step("grouped", m, dtype, finalize)
        out, ids, weights, shared, final = self._run(step, x, logits, bias, dtype)
        if finalize:
            return final[:m]
        return (*self._crop(m, out, ids, weights), shared[:m])

    def __call__(self, x, logits, bias):
        """The MoE layer's output BF16 [M, H] for any M >= 1: one launch up to
        the largest bucket, bucket-sized chunks above it
        (``runtime.chunks.run_chunked``: no host sync, graph-capturable; each
        chunk re-reads the experts its tokens need)."""
        rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
        if rows > self.largest:
            return run_chunked(self, x, logits, bias)
        m, dtype = self._check(x, logits, bias, None)
        step = self.tables[dtype].get(m)
        if step is None:
            raise InputError(f"no {dtype}-logits variant of this artifact serves M = {m}")
        out, ids, weights, shared, final = self._run(step, x, logits, bias, dtype)
        if self._variant(step, dtype).name in self.final_writers:
            return final[:m]
        out, ids, weights = self._crop(m, out, ids, weights)
        shared = shared[:m] if self.shape.shared_experts else None
        return combine(out, weights, shared)

    # Parts ----------------------------------------------------------------------

    def _check(self, x, logits, bias, kernel):
        dtypes = self.dtypes
        if kernel is not None:
            dtypes = tuple(d for d in LOGITS if (kernel, d) in self.buckets)
            if not dtypes:
                raise InputError(f"this artifact has no {kernel} variant for {self.artifact.arch}")
        m = check_call(x, logits, bias, self.shape, self.device, dtypes)
        return m, _DTYPE_NAMES[logits.dtype]

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

    def _run(self, step: Step, x, logits, bias, dtype: str):
        """Pads to the bucket, launches, returns bucket-sized outputs."""
        variant = self._variant(step, dtype)
        mb, k, h = step.bucket, self.shape.top_k, self.shape.hidden
        x, logits = pad_rows(x, mb), pad_rows(logits, mb)
        dev = self.device
        out = torch.empty(mb * k, h, dtype=torch.bfloat16, device=dev)
        ids = torch.empty(mb * k, dtype=torch.int32, device=dev)
        weights = torch.empty(mb * k, dtype=torch.float32, device=dev)
        shared = torch.empty(mb, h, dtype=torch.bfloat16, device=dev)
        final = torch.empty_like(shared) if variant.name in self.final_writers else shared
        if self.poison:
            for t in (out, weights, shared, final):
                t.fill_(float("nan"))
            ids.fill_(-1)
        buffers = {
            **self.tensors, **self.rows, "maps": self.maps[variant.tensor_maps],
            "x": x, "logits": logits, "bias": bias, "out": out, "ids": ids,
            "weights": weights, "shared_out": shared, "final": final,
        }  # fmt: skip
        self._launch(variant, buffers, mb)
        return out, ids.view(mb, k), weights.view(mb, k), shared, final

    def _variant(self, step: Step, dtype: str):
        return self.buckets[(step.kernel, dtype)][step.bucket][step.finalize]

    def _launch(self, variant, buffers: dict, bucket: int) -> None:
        """Fills ``variant``'s parameters by name and launches it on torch's
        current stream of the layer's device."""
        graphs.release()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        workspace = self.artifact.workspaces(self.ordinal).pointers(stream, variant)
        values = []
        for name, kind in variant.params:
            if kind == "i32":
                values.append(SCALARS[name](bucket, self.shape.top_k))
            elif name in workspace:
                values.append(workspace[name])
            else:
                values.append(buffers[name].data_ptr())
        # The device's context is current for the launch only (the legacy
        # default stream, handle 0, runs in the current context). Leaving it
        # current would move torch's current device to this layer's: the CUDA
        # runtime takes the thread's current context as its device.
        with driver.context(self.ordinal):
            # A graph being captured keeps this layer (weights, rows, maps,
            # the artifact's workspaces and libraries) alive: runtime.graphs.
            graphs.hold(stream, self)
            self.launchers[variant.name](stream, values)

    def _crop(self, m: int, out, ids, weights):
        return out[: m * self.shape.top_k], ids[:m], weights[:m]


def writes_final(variant) -> bool:
    """Whether ``variant`` writes the MoE output ``final`` itself: a grouped
    variant built with finalize, or a mega variant with a ``final``
    parameter (its last-arriving CTAs sum each token's rows)."""
    if variant.kernel == "mega":
        return any(name == "final" for name, _ in variant.params)
    return variant.finalize


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
    known = set(tensors) | {"maps", "rows1", "rows2", "rows", "x", "logits", "bias", "out",
                            "ids", "weights", "shared_out", "final"}  # fmt: skip
    known |= {w.name for w in variant.workspace}
    missing = []
    for name, kind in variant.params:
        if (kind == "i32" and name not in SCALARS) or (kind == "pointer" and name not in known):
            missing.append(f"{name} ({kind})")
    return missing

"""The layer as a PyTorch custom op, for torch.compile and serving engines.

``torch.ops.moe_build.moe_layer(Tensor x, Tensor logits, Tensor? bias, int
handle) -> Tensor``: the MoE output BF16 [M, H] for any M >= 0 (``bias``
None for a model that routes without a score-correction bias)
(``runtime.chunks.run_chunked``: one layer call up to the largest bucket,
row chunks above). ``handle`` is an opaque integer naming a bound layer in a
process-wide table: ``register(layer)`` adds one and returns its handle,
``unregister(handle)`` drops it. Serving engines pass layers to ops this way,
since an op's schema can carry only tensors and scalars; a compiled graph
holds the handle as a constant.

Schema facts torch relies on: the op mutates nothing and its output aliases
no input (a fresh tensor, or a view of one the layer allocated); it has no
autograd formula (inference only). The fake (meta) implementation gives
``torch.empty((M, H), dtype=torch.bfloat16, device=x.device)`` with H from
the handle's layer, after the checks the real call makes on metadata alone
(dtypes, ranks, shapes, device; density and alignment need real storage, so
the real call checks them). So ``torch.compile(..., fullgraph=True)`` traces
through the op with shapes known, and a CUDA graph can capture a call
(``run_chunked`` needs no host sync).

``MoEModule(layer)`` is a ``torch.nn.Module`` whose ``forward(x, logits, bias)``
calls the op; it registers the layer on construction and unregisters it when
the module is collected (or on ``close()``).

The real implementation is registered for every device type: it dispatches
to whatever the handle names (a ``runtime.moe.MoELayer`` launches on its CUDA
device; a stand-in with the same protocol may compute on the CPU, which the
CPU tests use). The protocol is ``runtime.chunks``'s.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from runtime.chunks import run_chunked
from runtime.errors import InputError
from runtime.inputs import LOGITS, check_bias

#: The op's qualified name and schema (an ``int`` handle: never symbolic).
NAME = "moe_build::moe_layer"
SCHEMA = "(Tensor x, Tensor logits, Tensor? bias, int handle) -> Tensor"

_layers: dict[int, object] = {}
_handles = itertools.count(1)
_lock = threading.Lock()


def register(layer) -> int:
    """Adds ``layer`` (``runtime.moe.MoELayer`` or the ``runtime.chunks``
    protocol) to the process-wide table; returns its handle, a positive int
    never reused in this process. The table holds the layer until
    ``unregister``."""
    missing = [a for a in ("shape", "device", "dtypes", "tables") if not hasattr(layer, a)]
    if missing or not callable(layer):
        raise TypeError(
            f"register: expected a bound layer (runtime.moe.MoELayer), found "
            f"{type(layer).__name__} (missing: {', '.join(missing) or '__call__'})"
        )
    with _lock:
        handle = next(_handles)
        _layers[handle] = layer
    return handle


def unregister(handle: int) -> None:
    """Drops ``handle``'s layer from the table; refuses an unknown handle. A
    CUDA graph that captured the op keeps what it launches alive itself
    (runtime.graphs); a compiled function calling the handle fails clearly."""
    with _lock:
        layer = _layers.pop(handle, None)
    if layer is None:
        raise InputError(_unknown(handle))


def lookup(handle: int):
    """The layer registered under ``handle``; InputError for an unknown one."""
    with _lock:
        layer = _layers.get(handle)
    if layer is None:
        raise InputError(_unknown(handle))
    return layer


def registered() -> list[int]:
    """Handles in the table, ascending."""
    with _lock:
        return sorted(_layers)


def _unknown(handle) -> str:
    with _lock:
        known = ", ".join(str(h) for h in sorted(_layers)) or "none"
    return (
        f"{NAME}: handle {handle!r} names no registered layer (registered: {known}); "
        "runtime.ops.register(layer) gives a handle"
    )


def _drop(handle: int) -> None:
    with _lock:
        _layers.pop(handle, None)


# Checks on metadata --------------------------------------------------------------


def check_meta(layer, x, logits, bias) -> None:
    """The checks of ``runtime.inputs.check_call`` that need no storage
    (dtype, rank, shape, device), with its messages; for the fake
    implementation, where tensors have no data."""
    shape, device = layer.shape, layer.device
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        found = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"x: expected a [M, {shape.hidden}] tensor, found {found}")
    m = x.shape[0]
    accepted = tuple(LOGITS[d] for d in layer.dtypes)
    _meta("x", x, (torch.bfloat16,), (m, shape.hidden), device)
    _meta("logits", logits, accepted, (m, shape.experts), device)
    check_bias(bias, shape, device, lambda name, t, dtype, dims, dev: _meta(name, t, (dtype,),
                                                                         dims, dev))  # fmt: skip


def _meta(name: str, t, dtypes, dims, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes) or "none (no bound variant)"
        raise InputError(f"{name}: expected dtype {want}, found {t.dtype}")
    if t.dim() != len(dims) or any(a != b for a, b in zip(t.shape, dims, strict=True)):
        raise InputError(f"{name}: expected shape {list(dims)}, found {list(t.shape)}")
    if t.device != device:
        raise InputError(f"{name}: expected device {device}, found {t.device}")


# The op -------------------------------------------------------------------------------


@torch.library.custom_op(NAME, mutates_args=(), schema=SCHEMA)
def moe_layer(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:  # fmt: skip
    """BF16 [M, H]: the MoE output of ``handle``'s layer (module docstring)."""
    return run_chunked(lookup(handle), x, logits, bias)


@moe_layer.register_fake
def _moe_layer_fake(x, logits, bias, handle):
    layer = lookup(handle)
    check_meta(layer, x, logits, bias)
    return torch.empty((x.shape[0], layer.shape.hidden), dtype=torch.bfloat16, device=x.device)


class MoEModule(torch.nn.Module):
    """``forward(x, logits, bias=None)`` -> BF16 [M, H] through the op.

    Registers ``layer`` on construction (``handle``) and unregisters it when
    the module is collected or ``close()`` is called. ``bias``: FP32 [E] kept
    as a buffer and used when ``forward`` gets none (the router's score
    correction bias belongs to the layer's weights); a model without one
    takes none."""

    def __init__(self, layer, bias: torch.Tensor | None = None):
        super().__init__()
        self.handle = register(layer)
        self._release = weakref.finalize(self, _drop, self.handle)
        self.hidden = layer.shape.hidden
        #: False for a model without a score-correction bias: forward passes None.
        self.routes_with_bias = getattr(layer.shape, "bias", True)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def layer(self):
        return lookup(self.handle)

    def forward(self, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor | None = None):
        if bias is None and self.routes_with_bias:
            bias = self.bias
            if bias is None:
                raise InputError("bias: none given and the module holds none")
        return torch.ops.moe_build.moe_layer(x, logits, bias, self.handle)

    def close(self) -> None:
        """Unregisters the layer now; later calls fail with an unknown handle."""
        self._release()

    def extra_repr(self) -> str:
        return f"handle={self.handle}, hidden={self.hidden}"


__all__ = ["NAME", "MoEModule", "check_meta", "lookup", "moe_layer", "register", "unregister"]

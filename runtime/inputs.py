"""Checks of a call's tensors and of a weight set, before anything launches.

Every error names the argument, what the bound variants expect and what was
found. Kernels read their inputs through bare pointers of static shapes, so
anything but the exact dtype, shape, device and a dense row-major layout
would be read wrong, not refused, by the GPU.
"""

from __future__ import annotations

import torch

from runtime.constants import LOGITS_DTYPES, MAX_TOKENS, TILE
from runtime.errors import InputError
from runtime.model import MoEShape

#: Every kernel pointer is assumed 16-byte aligned (vector loads).
ALIGN = 16
#: Logits dtype name (an artifact's ``logits_dtype``) -> its torch dtype.
LOGITS = {name: getattr(torch, name) for name in LOGITS_DTYPES}
#: The reverse: torch dtype -> logits dtype name.
LOGITS_NAMES = {dtype: name for name, dtype in LOGITS.items()}


def check_tensor(name: str, t, dtype, shape, device: torch.device) -> None:
    """``t`` is a dense, 16-byte aligned ``dtype`` tensor of ``shape`` on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise InputError(f"{name}: expected dtype {want}, found {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name}: expected shape {list(shape)}, found {list(t.shape)}")
    if t.device != device:
        raise InputError(f"{name}: expected device {device}, found {t.device}")
    if not t.is_contiguous():
        raise InputError(f"{name}: expected a contiguous tensor, found strides {t.stride()}")
    if t.data_ptr() % ALIGN:
        raise InputError(
            f"{name}: expected a {ALIGN}-byte aligned address, found {t.data_ptr():#x}"
        )


#: logits_dtypes tuples a call was accepted with -> their torch dtypes.
_ACCEPTED: dict[tuple, tuple] = {}


def check_call(x, logits, bias, shape: MoEShape, device: torch.device,
               logits_dtypes, max_tokens: int | None = MAX_TOKENS,
               least: int = 1) -> int:  # fmt: skip
    """Validates one call; returns M. ``logits_dtypes``: names the bound
    variants accept (``float32``/``bfloat16``); ``max_tokens`` None: no upper
    bound on M (a chunked call); ``least``: the smallest M accepted (0 for the
    layer's entry, where an empty batch is an empty output).

    A call that passes every check returns from ``_passes``, which compares
    against the expected values and builds no message; anything else (and
    the first call with a given ``logits_dtypes``) runs ``_check_call``, the
    checks in their order, which raises the first failure's message."""
    accepted = _ACCEPTED.get(logits_dtypes) if type(logits_dtypes) is tuple else None
    if accepted is not None:
        m = _passes(x, logits, bias, shape, device, accepted, max_tokens)
        if m is not None:
            return m
    m = _check_call(x, logits, bias, shape, device, logits_dtypes, max_tokens, least)
    if type(logits_dtypes) is tuple:
        _ACCEPTED[logits_dtypes] = tuple(LOGITS[d] for d in logits_dtypes)
    return m


def _passes(x, logits, bias, shape: MoEShape, device: torch.device, accepted: tuple,
            max_tokens: int | None) -> int | None:  # fmt: skip
    """M when the call passes every check of ``_check_call`` (``accepted``:
    the logits dtypes), else None: it accepts no call that ``_check_call``
    refuses, and a call it does not accept goes to ``_check_call`` (so does
    every M = 0 call, which only some entries accept)."""
    if not (isinstance(x, torch.Tensor) and isinstance(logits, torch.Tensor)):
        return None
    if not shape.bias:
        if bias is not None:
            return None
        bias = x  # the checks below then hold for bias whenever they hold for x
    elif not isinstance(bias, torch.Tensor):
        return None
    rows = x.shape
    if len(rows) != 2:
        return None
    m = rows[0]
    if m < 1 or (max_tokens is not None and m > max_tokens):
        return None
    if (
        x.dtype != torch.bfloat16
        or logits.dtype not in accepted
        or (bias is not x and bias.dtype != torch.float32)
        or rows[1] != shape.hidden
        or logits.shape != (m, shape.experts)
        or (bias is not x and bias.shape != (shape.experts,))
        or x.device != device
        or logits.device != device
        or bias.device != device
        or not (x.is_contiguous() and logits.is_contiguous() and bias.is_contiguous())
        or (x.data_ptr() | logits.data_ptr() | bias.data_ptr()) % ALIGN
    ):
        return None
    return m


def _check_call(x, logits, bias, shape: MoEShape, device: torch.device,
                logits_dtypes, max_tokens: int | None, least: int) -> int:  # fmt: skip
    """``check_call``'s checks in order, each failure with its message."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        found = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"x: expected a [M, {shape.hidden}] tensor, found {found}")
    m = x.shape[0]
    if max_tokens is None and m < least:
        raise InputError(f"x: expected M (tokens) >= {least}, found {m}")
    if max_tokens is not None and not least <= m <= max_tokens:
        raise InputError(f"x: expected M (tokens) in {least}..{max_tokens}, found {m}")
    check_tensor("x", x, torch.bfloat16, (m, shape.hidden), device)
    accepted = tuple(LOGITS[d] for d in logits_dtypes)
    if not accepted:
        raise InputError("logits: no bound variant serves this call")
    check_tensor("logits", logits, accepted, (m, shape.experts), device)
    check_bias(bias, shape, device)
    return m


def check_bias(bias, shape: MoEShape, device: torch.device, check=check_tensor) -> None:
    """``bias``: FP32 [E] on ``device`` for a model that routes with a
    score-correction bias; None for one without (the kernels were compiled
    not to read it, and a tensor there would be silently unused)."""
    if shape.bias:
        if bias is None:
            raise InputError(f"bias: this model routes with a score-correction bias: pass the "
                             f"FP32 [{shape.experts}] tensor, found None")  # fmt: skip
        check("bias", bias, torch.float32, (shape.experts,), device)
    elif bias is not None:
        raise InputError("bias: this model routes without a score-correction bias "
                         "(model.bias false): pass None")  # fmt: skip


def expert_shapes(experts: int, hidden: int, inter: int) -> dict:
    """Name -> (dtype, shape) of one ``ExpertWeights`` in the kernel layout."""
    return {
        "w13": (torch.float8_e4m3fn, (experts, hidden // TILE, 2 * inter, TILE)),
        "w13_scale": (torch.float32, (experts, 2 * inter // TILE, hidden // TILE)),
        "w2": (torch.float8_e4m3fn, (experts, inter // TILE, hidden, TILE)),
        "w2_scale": (torch.float32, (experts, hidden // TILE, inter // TILE)),
    }


def check_weights(weights, shape: MoEShape, device: torch.device) -> dict:
    """Validates a ``runtime.layout.MoEWeights`` for ``shape`` on ``device``;
    returns the kernels' weight tensors by parameter name (``w13``, ...,
    ``s13``, ``s13_scale``, ``s2``, ``s2_scale``)."""
    routed = getattr(weights, "routed", None)
    shared = getattr(weights, "shared", None)
    if routed is None:
        raise InputError(
            f"weights: expected a runtime.layout.MoEWeights, found {type(weights).__name__}"
        )
    if shape.shared_experts and shared is None:
        raise InputError("weights.shared: the config has a shared expert, the weights none")
    tensors = {}
    sets = [("", routed, shape.experts)]
    if shared is not None:
        sets.append(("s", shared, 1))
    for prefix, part, experts in sets:
        for name, (dtype, dims) in expert_shapes(experts, shape.hidden, shape.inter).items():
            label = f"weights.{'shared' if prefix else 'routed'}.{name}"
            t = getattr(part, name, None)
            check_tensor(label, t, dtype, dims, device)
            key = name if not prefix else "s" + name[1:]
            tensors[key] = t
    return tensors

"""Any number of tokens through a layer that serves 1..B in one launch: row chunks.

A layer call serves M up to its largest token bucket B (512 for the
configs' builds, 448 for Kimi-K2 TP8's; ``runtime.constants.MAX_TOKENS``
bounds it).
An empty batch (M = 0) is checked as any call and gives an empty output
without a launch. ``chunk_plan(m, buckets)`` splits M >= 1 rows into pieces that one call each
serves: M up to the largest bucket is one piece; above it, pieces
of the largest bucket in row order, then one final piece of the remainder
(served at its own bucket: the grouped kernel takes its rows with
``valid``, the mega kernel's are padded, ``runtime.plan``). So at most one
piece is partial, and it is the last.

``run_chunked(layer, x, logits, bias)`` runs the plan into one preallocated
[M, H] output: a layer with ``launch_rows`` (``runtime.moe.MoELayer``) runs
every full piece as one launch whose kernel reads the piece's rows of the
caller's tensors and writes its rows of the output in place (no views, no
copies, one host path for all of them), and the partial last piece so too
where a variant that writes the output serves its rows so (at its own
bucket, or a grouped variant that takes ``valid``, which reads and writes
the piece's rows alone); any other piece (a partial one no variant serves
so, or every piece of a layer without
``launch_rows``) is one layer call on a row slice of the caller's tensors,
its BF16 result copied into the output. Only device ops and layer calls, no
host sync: it can be captured in a CUDA graph (one graph per M, as for the
layer).
Every token's output depends on its own row only (routing and experts are per
token), so chunked results equal unchunked ones row for row.

What a chunk costs. Decode MoE is bound by the weight bytes a call reads
(docs/semantics.md, "Sizes"), and each chunk is a separate call: it re-reads
every expert its tokens route to. A chunk of the largest bucket reads about
as many bytes as one call of that bucket (on the glm5 shard, uniform
routing touches ~280 of 288 experts at M = 128, nearly the whole layer;
~470 us on the H200: docs/notes/grouped-sm90.md, "Buckets above 64"), so N
chunks cost about N times that, however few tokens each expert gets. A
grouped GEMM over all M tokens reads each expert once and is bound by the
weights up to thousands of tokens. So chunking is for the occasional decode
batch above the largest bucket (a few chunks); beyond a few
hundred tokens per call (prefill), a server should route the call to a
compute-bound grouped-GEMM path instead, which reads each expert once where
chunks read it once per chunk.

The layer protocol used here (``runtime.moe.MoELayer`` has it): ``shape``
(``hidden``, ``experts``), ``device``, ``dtypes`` (the logits dtype names it
serves), ``tables`` (logits dtype name -> {M: step} for every M one call
serves), ``poison`` (optional), ``launch_rows(x, logits, bias, out, starts,
rows)`` -> bool (optional: launches the pieces of ``rows`` rows at ``starts``
into ``out`` in place, or returns False having launched nothing) and
``__call__(x, logits, bias)`` -> BF16 [M, H].
"""

from __future__ import annotations

import torch

from runtime.errors import InputError
from runtime.inputs import ALIGN, LOGITS_NAMES, check_call
from runtime.plan import bucket_for, pad_rows


def chunk_plan(m: int, buckets) -> list[tuple[int, int]]:
    """[(start, rows)] covering rows 0..m-1 in order, each piece served by one
    bucket of ``buckets`` (token counts, any order): ``[(0, m)]`` when ``m``
    fits the largest bucket B; else ``m // B`` pieces of B rows, then one of
    ``m % B`` rows when that is not zero. Pure and deterministic."""
    sizes = sorted(set(buckets))
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"buckets: expected positive token counts, found {list(buckets)}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m: expected a token count >= 1, found {m!r}")
    return _pieces(m, sizes[-1])


def _pieces(m: int, largest: int) -> list[tuple[int, int]]:
    """``chunk_plan`` of checked arguments (``largest`` the largest bucket)."""
    if m <= largest:
        return [(0, m)]
    full, rest = divmod(m, largest)
    pieces = [(i * largest, largest) for i in range(full)]
    if rest:
        pieces.append((full * largest, rest))
    return pieces


def served(layer, logits_dtype: torch.dtype) -> list[int]:
    """The M values one call of ``layer`` serves with logits of ``logits_dtype``,
    ascending; refuses a dtype the layer does not serve."""
    name = LOGITS_NAMES.get(logits_dtype)
    table = layer.tables.get(name) if name is not None else None
    if not table:
        accepted = ", ".join(f"torch.{d}" for d in layer.dtypes) or "none"
        raise InputError(f"logits: expected dtype {accepted}, found {logits_dtype}")
    return sorted(table)


def check_inputs(layer, x, logits, bias) -> int:
    """Validates a call of any M >= 0 as the layer validates one of 1..MAX_TOKENS
    (``runtime.inputs.check_call``: dtypes, shapes, device, dense row-major,
    16-byte aligned); returns M."""
    return check_call(x, logits, bias, layer.shape, layer.device, layer.dtypes, None, least=0)


def check_output(out, m: int, hidden: int, device: torch.device) -> None:
    """``out`` is a dense BF16 [m, hidden] tensor on ``device``."""
    if not isinstance(out, torch.Tensor):
        raise InputError(f"out: expected a torch.Tensor, found {type(out).__name__}")
    if (
        out.dtype != torch.bfloat16
        or tuple(out.shape) != (m, hidden)
        or out.device != device
        or not out.is_contiguous()
    ):
        raise InputError(
            f"out: expected a contiguous torch.bfloat16 [{m}, {hidden}] tensor on {device}, "
            f"found {out.dtype} {list(out.shape)} on {out.device} with strides {out.stride()}"
        )


def run_chunked(layer, x, logits, bias, out: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's output BF16 [M, H] for any M >= 0 (module docstring); for
    M = 0 (an empty batch, checked as any call) an empty one, launching nothing.

    ``x`` BF16 [M, H], ``logits`` [M, E] (a dtype the layer serves), ``bias``
    FP32 [E], all dense on the layer's device. ``out``: BF16 [M, H] to write
    the result into (default: a fresh tensor, or for a single piece the
    layer's own output). With ``layer.poison`` the output is NaN-filled first,
    so rows no chunk wrote show. Row slices of dense rows stay dense, and
    aligned where a chunk's rows of logits are a multiple of 16 bytes (H is
    a multiple of 128; chunks start at multiples of the largest bucket,
    which a multiple of 8 makes so for any E), so each chunk passes the
    layer's checks as the whole call did (a layer call on a chunk of a
    custom table that is not gets aligned copies of its rows). An M the layer's table serves in
    one launch goes straight to the layer, which checks the call itself
    (the torch op's common case: one check, no table sort)."""
    if out is None and _one_launch(layer, x, logits):
        return layer(x, logits, bias)
    m = check_inputs(layer, x, logits, bias)
    hidden = layer.shape.hidden
    if out is not None:
        check_output(out, m, hidden, layer.device)
    else:
        out = torch.empty(m, hidden, dtype=torch.bfloat16, device=layer.device)
    if m == 0:
        return out
    sizes = served(layer, logits.dtype)
    largest = sizes[-1]
    # served() gives the table's M values, positive ints in order, so the
    # plan skips chunk_plan's argument checks (their cost a call:
    # docs/notes/host-path.md, "Chunked calls").
    pieces = _pieces(m, largest)
    if getattr(layer, "poison", False):
        out.fill_(float("nan"))
    # The full pieces, straight into their rows of ``out`` where the layer can
    # (``MoELayer.launch_rows``: no views, no copies), and so the partial
    # last one where a variant that writes the output serves its rows so (at
    # its own bucket, or taking ``valid``); the rest, and every piece of a
    # layer that cannot, one layer call each and a copy.
    direct = getattr(layer, "launch_rows", None)
    full = [start for start, rows in pieces if rows == largest]
    if full and direct is not None and direct(x, logits, bias, out, full, largest):
        pieces = [(start, rows) for start, rows in pieces if rows != largest]
    for start, rows in pieces:
        if rows != largest and direct is not None and direct(x, logits, bias, out, [start], rows):
            continue
        out[start : start + rows].copy_(_call(layer, x, logits, bias, start, rows, sizes))
    return out


def _one_launch(layer, x, logits) -> bool:
    """Whether ``layer`` serves this call's M rows in one launch: M is in its
    table for the logits' dtype (tensors only; anything else takes the
    checks, which say what is wrong)."""
    if not (isinstance(x, torch.Tensor) and isinstance(logits, torch.Tensor) and x.dim() == 2):
        return False
    table = layer.tables.get(LOGITS_NAMES.get(logits.dtype))
    return bool(table) and x.shape[0] in table


def _call(layer, x, logits, bias, start: int, rows: int, sizes: list[int]) -> torch.Tensor:
    """One layer call on rows ``start .. start+rows-1``: BF16 [rows, H]. A
    piece of an M the layer's table skips (a custom table with holes) is
    padded to the next M it serves, as the layer pads to a bucket. A slice
    whose start is off the 16-byte alignment the layer checks is passed as
    a copy (``_aligned``)."""
    xs, ls = _aligned(x[start : start + rows]), _aligned(logits[start : start + rows])
    if rows in sizes:
        return layer(xs, ls, bias)
    call = bucket_for(rows, sizes)
    return layer(pad_rows(xs, call), pad_rows(ls, call), bias)[:rows]


def _aligned(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (a dense row slice), or a copy of them where the slice starts
    off ``ALIGN`` bytes: logits rows are 2E or 4E bytes, so with an odd E in
    BF16 a chunk start that is not a multiple of 8 rows is only 2-byte
    aligned (x rows, H a multiple of 128, always are). The kernels read
    logits by element, so only the layer's checks need this."""
    return rows if rows.data_ptr() % ALIGN == 0 else rows.clone()


__all__ = ["check_inputs", "check_output", "chunk_plan", "run_chunked", "served"]

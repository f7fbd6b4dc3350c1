"""Which variant serves a call of M tokens, and how its inputs are padded.

A variant serves one token bucket. M tokens run in the bucket equal to M if
there is one, else in the smallest bucket above M; the extra rows repeat the
last real token and its logits, so they route to experts the call already
reads (no extra weight traffic) and their outputs are dropped.

The layer's default table: the mega kernel up to its largest bucket, the
grouped kernel above (with in-kernel finalize when such a variant exists).
``MoELayer`` takes another table; the benchmark decides the final one.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.constants import MAX_TOKENS


@dataclass(frozen=True)
class Step:
    """Run ``kernel`` at bucket ``bucket`` (>= the call's M), with the
    grouped kernel's in-kernel ``finalize``."""

    kernel: str
    bucket: int
    finalize: bool = False


def bucket_for(m: int, buckets) -> int | None:
    """The bucket serving ``m`` tokens: ``m`` itself, else the smallest one
    above it; None when every bucket is smaller."""
    above = [b for b in buckets if b >= m]
    return min(above) if above else None


def default_table(buckets: dict[str, dict[int, set[bool]]],
                  max_tokens: int = MAX_TOKENS) -> dict[int, Step]:  # fmt: skip
    """M -> Step for every M in 1..max_tokens some kernel can serve.

    ``buckets``: kernel -> {bucket: finalize settings compiled}, for one logits
    dtype. Mega takes every M up to its largest bucket; grouped the rest,
    finalizing in-kernel where a ``final`` variant exists."""
    table = {}
    mega = buckets.get("mega", {})
    grouped = buckets.get("grouped", {})
    for m in range(1, max_tokens + 1):
        b = bucket_for(m, mega)
        if b is not None:
            table[m] = Step("mega", b)
            continue
        b = bucket_for(m, grouped)
        if b is not None:
            table[m] = Step("grouped", b, finalize=True in grouped[b])
    return table


def padding(m: int, bucket: int) -> int:
    """Rows to append to ``m`` tokens to fill ``bucket``."""
    if not 1 <= m <= bucket:
        raise ValueError(f"{m} tokens do not fit bucket {bucket}")
    return bucket - m


def pad_sources(largest: int, device=None):
    """int64 [largest, largest]: entry [m - 1, i] is the row of an [m, ...]
    tensor that row i of its padded form copies: i for i < m, else m - 1 (the
    last token, repeated). Row m - 1's first ``bucket`` entries pad m rows to
    any ``bucket`` up to ``largest``. Made by device ops on ``device`` (no
    host copy, so it may run during a CUDA graph capture)."""
    import torch

    i = torch.arange(largest, device=device)
    return torch.minimum(i[None, :], i[:, None])


def pad_rows(t, bucket: int, source=None):
    """``t`` [M, ...] extended to [bucket, ...] by repeating its last row
    (``t`` itself when M == bucket); a fresh contiguous tensor otherwise (one
    gather). ``source``: the int64 [bucket] row index on ``t``'s device,
    ``pad_sources(n)[M - 1, :bucket]`` for some n >= bucket, when the caller
    keeps one; else it is made here."""
    m = t.shape[0]
    if padding(m, bucket) == 0:
        return t
    if source is None:
        source = pad_sources(bucket, t.device)[m - 1]
    return t.index_select(0, source)

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


def pad_rows(t, bucket: int):
    """``t`` [M, ...] extended to [bucket, ...] by repeating its last row
    (``t`` itself when M == bucket); a fresh contiguous tensor otherwise."""
    import torch

    extra = padding(t.shape[0], bucket)
    if extra == 0:
        return t
    return torch.cat([t, t[-1:].expand(extra, *t.shape[1:])], dim=0)

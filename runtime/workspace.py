"""Scratch buffers the runtime owns per (device, stream).

A kernel's workspace (the grouped kernel's token plan, hidden blocks, FC1
partials and parity counters) is read and written by every call, so two
streams running at once must never share one: each (device, stream) gets its
own. Calls on one stream run one after another, so variants of one kernel that
declare the same record (name, bytes, zero) share that buffer there; a
record that differs gets its own buffer.

Buffers come from ``cuMemAlloc`` outside torch's allocator and outside any
graph capture in flight, and buffers with ``zero`` are zero-filled exactly once
(a captured memset would re-zero the counters at every replay, breaking the
kernels' call-parity protocol).
"""

from __future__ import annotations

import threading
import weakref

from runtime import driver
from runtime.artifact import Variant


class Workspaces:
    """All workspaces of one device; freed with this object."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self._buffers: dict[tuple, int] = {}
        self._by_variant: dict[tuple[int, str], dict[str, int]] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _free_all, ordinal, self._buffers)

    def pointers(self, stream: int, variant: Variant) -> dict[str, int]:
        """Device address of each of ``variant``'s workspaces on ``stream``,
        allocated (and zeroed where asked) on first use."""
        key = (stream, variant.name)
        found = self._by_variant.get(key)
        if found is not None:
            return found
        with self._lock:
            found = {}
            for need in variant.workspace:
                record = (stream, variant.kernel, need.name, need.bytes, need.zero)
                found[need.name] = self._buffer(record, need.bytes, need.zero)
            self._by_variant[key] = found
            return found

    def scratch(self, stream: int, nbytes: int) -> int:
        """Device address of ``nbytes`` (not zeroed) that calls on ``stream``
        may write and never read back: the routes' rows, ids, weights and
        shared rows of a call that returns only its MoE output (the kernel
        writes them, then reads them itself). Made on first use, then shared
        by every such call on ``stream`` of the layers bound from this
        artifact on this device (calls on a stream run one after another)."""
        record = (stream, "outputs", nbytes, False)
        found = self._buffers.get(record)
        if found is not None:
            return found
        with self._lock:
            return self._buffer(record, nbytes, False)

    def _buffer(self, record: tuple, nbytes: int, zero: bool) -> int:
        """The buffer of ``record``, allocated on first use (hold ``_lock``)."""
        if record not in self._buffers:
            self._buffers[record] = driver.alloc(self.ordinal, nbytes, zero)
        return self._buffers[record]

    def streams(self) -> set[int]:
        return {record[0] for record in self._buffers}

    def close(self) -> None:
        self._finalizer()


def _free_all(ordinal: int, buffers: dict) -> None:
    for pointer in buffers.values():
        try:
            driver.free(ordinal, pointer)
        except Exception:  # noqa: BLE001 - at exit the context may be gone already
            pass
    buffers.clear()

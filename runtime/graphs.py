"""What a captured launch points at lives as long as the graph that holds it.

A CUDA graph node keeps the raw values of a launch's parameters: the device
addresses of the weights, row tables, tensor maps and workspaces, and the
function of a loaded library. Python objects own all of these (the layer, its
artifact, the artifact's workspaces and libraries), so a graph replayed after
its layer was collected, or after ``Artifact.close``, would read freed memory.

Protocol: when a layer launches on a stream that is being captured,
``hold(stream, owner)`` puts a strong reference to ``owner`` (the layer,
which reaches everything above) in ``_held`` under a fresh key, and moves the
one reference of a CUDA user object with that key into the graph being
captured. The graph, and every executable graph instantiated from it, keep
the user object; once all of them are destroyed the driver runs the object's
destructor on an internal thread. That thread may not call CUDA, and dropping
the last reference to a layer can free workspaces (``cuMemFree``) and unload
libraries, so the destructor only appends the key to ``_released``;
``release()`` drops those references. It runs at every layer launch and in
``Artifact.close``, and may be called by anyone; until then the memory of a
destroyed graph's layer stays allocated.

``Artifact.close`` refuses while a graph still holds one of its layers
(``holding``), so neither deleting objects nor closing can free what a live
graph launches. A capture that is aborted destroys its graph, which releases
its holds the same way.

Which launches ask: the driver's capture query (``cuStreamGetCaptureInfo``,
several microseconds through cuda.bindings) decides whether and into which
graph a launch is captured. A layer asks it unless ``capture_possible`` rules
a capture out with torch's cheaper query; that function's docstring is the
argument that it never rules out a capture that is underway.
"""

from __future__ import annotations

import ctypes
import itertools
import threading

import torch

from runtime import driver

_held: dict[int, object] = {}
#: Keys whose graphs are gone; appended by the driver's thread (list.append
#: is atomic under the GIL), drained by ``release``.
_released: list[int] = []
_keys = itertools.count(1)
_lock = threading.Lock()


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _on_graph_destroyed(key) -> None:
    _released.append(int(key or 0))


#: The destructor's address; the ctypes object above stays alive with the module.
_DESTROY = ctypes.cast(_on_graph_destroyed, ctypes.c_void_p).value


def hold(stream: int, owner) -> bool:
    """If ``stream`` is being captured, keeps ``owner`` alive for as long as
    the graph (and its instantiations) exist; returns whether it did."""
    graph = driver.capturing_graph(stream)
    if graph is None:
        return False
    with _lock:
        key = next(_keys)
        _held[key] = owner
    try:
        driver.retain_in_graph(graph, key, _DESTROY)
    except BaseException:
        with _lock:
            _held.pop(key, None)
        raise
    return True


def capture_possible(ordinal: int) -> bool:
    """Whether torch's current stream of CUDA device ``ordinal`` may be
    being captured; False only when it provably is not, so a caller that
    launches on that stream may then skip ``hold``.

    Why False is safe: ``torch.cuda.is_current_stream_capturing()`` is the
    CUDA runtime's ``cudaStreamIsCapturing`` on torch's current stream of
    torch's current device (it answers False without asking only when that
    device has no primary context). It asks the driver's state of the
    stream, not torch's bookkeeping, so it sees every capture of it:
    ``torch.cuda.graph``, or one begun by any other code through the runtime
    or the driver API, in any capture mode, and a stream joined into another
    stream's capture. When torch's current device is ``ordinal``, its current
    stream is the stream a layer bound there launches on (torch's current
    stream of the layer's device), and that device has a primary context
    (the layer's weights live in it), so False proves no capture of that
    stream. When another device is current, torch's answer concerns another
    stream: True, the driver decides. True also covers a capture torch sees
    invalidated; ``hold`` then holds nothing (only an active capture has a
    graph)."""
    if torch.cuda.current_device() != ordinal:
        return True
    return torch.cuda.is_current_stream_capturing()


def release() -> int:
    """Drops the references of graphs that were destroyed; returns how many.
    Runs at every launch: with nothing released it returns at once."""
    if not _released:
        return 0
    dropped = []
    with _lock:
        while _released:
            dropped.append(_held.pop(_released.pop(), None))
    count = sum(1 for d in dropped if d is not None)
    del dropped  # the last references may free memory here, outside the lock
    return count


def holding(predicate) -> int:
    """How many live graph holds have an owner for which ``predicate`` is true."""
    with _lock:
        owners = list(_held.values())
    return sum(1 for owner in owners if predicate(owner))


__all__ = ["capture_possible", "hold", "holding", "release"]

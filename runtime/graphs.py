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
"""

from __future__ import annotations

import ctypes
import itertools
import threading

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


__all__ = ["hold", "holding", "release"]

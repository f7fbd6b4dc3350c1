"""Thin runtime: serve prebuilt MoE artifacts with cuda.bindings and torch only.

``runtime.load(path)`` verifies an artifact (directory or ``.tar.zst``) and
loads its cubins for the current device's arch; ``artifact.bind(weights)``
gives a layer with the calling conventions of docs/semantics.md (runtime.moe). No CuTe DSL,
no compiler and no JIT: this package never imports cutlass.
"""

from __future__ import annotations


def load(path, device=None):
    """See ``runtime.loader.load``."""
    from runtime.loader import load as _load

    return _load(path, device)


__all__ = ["load"]

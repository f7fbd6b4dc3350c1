"""The compile step every kernel shares: a kernel object's launch compiled
over fake arguments (``kernels.abi.fake_arguments``) and a fake stream, its
PTX and cubin read from a private dump directory (whatever ``CUTE_DSL_KEEP``
says, and nothing left in the working directory), and the one entry name
read back from the PTX (``kernels.spec.entry_from_ptx``); and the launch of
a named entry that every kernel's entry points make (``launch_named``).
Imports cutlass when called.
"""

from __future__ import annotations

import tempfile

from kernels.spec import entry_from_ptx


def compile_entry(entry, args, prefix: str) -> tuple[bytes, str, str]:
    """Compiles the jit function ``entry`` over ``args`` (ABI order) and a
    fake stream; returns ``(cubin, ptx, entry name)``. ``prefix``: the
    entry's name prefix (the PTX must hold exactly one entry named so) and
    the dump directory's."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    with tempfile.TemporaryDirectory(prefix=f"{prefix}-") as dump:
        compiled = cute.compile(entry, *args, make_fake_stream(),
                                options=f"--keep-ptx --keep-cubin --dump-dir={dump}")  # fmt: skip
        cubin, ptx_text = compiled.artifacts.CUBIN, compiled.artifacts.PTX
    if not cubin or not ptx_text:
        raise RuntimeError(f"the DSL kept no cubin/PTX for {prefix}")
    return bytes(cubin), ptx_text, entry_from_ptx(ptx_text, prefix)


def launch_named(owner, kernel, args, stream) -> None:
    """From a jit entry point: names ``kernel`` (a ``cute.kernel`` method of
    ``owner``) ``owner.ENTRY`` in the PTX (no cutlass symbol, not mangled:
    the name the runtime looks up) and launches it over ``args`` through
    the arch's ``owner.launch``."""
    kernel.set_name_prefix(owner.ENTRY, remove_cutlass_symbol=True, keep_mangled_name=False)
    owner.launch(kernel(*args), stream)

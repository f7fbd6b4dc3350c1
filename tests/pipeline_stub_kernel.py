"""A pure-Python stand-in kernel module for fast pipeline tests (no DSL).

``compile_kernel(spec)`` returns a CompiledKernel whose cubin is a small but
well-formed CUDA ELF file (``make_cubin``) carrying the facts the pipeline
reads: architecture flags, the CUDA API version, registers, local frame,
stack, parameter layout, ``.reqntid`` and static shared memory. Its code
bytes are derived from every spec field, so a changed spec changes the cubin.

Switches (environment, inherited by worker processes):
- ``MOE_BUILD_STUB_LOG=path``: append one line per compile (the variant's
  name), so tests can count what was compiled rather than served from cache;
- ``MOE_BUILD_STUB_FAIL=name[,name]``: raise a compiler-like error for those
  variants;
- ``MOE_BUILD_STUB_BAD_ABI=name[,name]``: declare one parameter more than the
  cubin has;
- ``MOE_BUILD_STUB_CRASH=name``: kill the worker process (a compiler crash);
- ``MOE_BUILD_STUB_SLEEP=seconds``: take that long per compile.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from dataclasses import astuple

from kernels.spec import CompiledKernel, KernelSpec, LaunchShape, Param, Workspace

_FLAGS = {"sm_90a": (7, 0x33, 0x5A0D5A), "sm_100a": (8, 0x41, 0x600640A)}


def variant_name(spec: KernelSpec) -> str:
    final = "-final" if spec.finalize else ""
    return f"{spec.kernel}-{spec.arch}-m{spec.tokens}-{spec.logits_dtype}{final}"


def compile_kernel(spec: KernelSpec) -> CompiledKernel:
    name = variant_name(spec)
    log = os.environ.get("MOE_BUILD_STUB_LOG")
    if log:
        with open(log, "a") as f:
            f.write(name + "\n")
    time.sleep(float(os.environ.get("MOE_BUILD_STUB_SLEEP", "0")))
    if name in os.environ.get("MOE_BUILD_STUB_CRASH", "").split(","):
        os._exit(139)
    if name in os.environ.get("MOE_BUILD_STUB_FAIL", "").split(","):
        raise RuntimeError(f"ptxas fatal: stub failure for {name}")
    params = [Param("x", "pointer"), Param("out", "pointer"), Param("count", "i32")]
    entry = f"stub_{spec.kernel}_{spec.arch}_0"
    block = (128, 1, 1)
    code = hashlib.sha256(repr(astuple(spec)).encode()).digest() * 4
    cubin = make_cubin(spec.arch, entry, [8, 8, 4], block, code, registers=32 + spec.tokens,
                       static_smem=1024 if spec.kernel == "grouped" else 0)  # fmt: skip
    if name in os.environ.get("MOE_BUILD_STUB_BAD_ABI", "").split(","):
        params.append(Param("extra", "pointer"))
    grid = (spec.sms, 1, 1) if spec.kernel == "grouped" else (spec.tokens * 16, 1, 1)
    return CompiledKernel(
        cubin=cubin,
        entry=entry,
        params=tuple(params),
        launch=LaunchShape(
            grid=grid,
            block=block,
            cluster=None if spec.kernel == "grouped" else (16, 1, 1),
            smem=4096,
            pdl=True,
        ),  # fmt: skip
        tensor_maps=("w13", "w2"),
        workspace=(Workspace("counters", 64, zero=True),) if spec.kernel == "grouped" else (),
        notes={"stub": True},
    )


def make_cubin(arch: str, entry: str, param_sizes: list[int], block: tuple[int, int, int],
               code: bytes, registers: int = 32, frame: int = 0, stack: int = 0,
               static_smem: int = 0, api_version: int = 129) -> bytes:  # fmt: skip
    """A minimal CUDA ELF file with one kernel, laid out as ptxas lays out its
    attributes (see pipeline/elf.py for the format)."""
    abi, osabi, flags = _FLAGS[arch]
    names = [".shstrtab", ".strtab", ".symtab", ".nv.info", f".nv.info.{entry}",
             f".text.{entry}", f".nv.shared.{entry}"]  # fmt: skip
    shstr = b"\0" + b"".join(n.encode() + b"\0" for n in names)
    strtab = b"\0" + entry.encode() + b"\0"
    text_index, sym_index = 6, 1
    symtab = bytes(24) + struct.pack("<IBBHQQ", 1, 0x12, 0, text_index, 0, len(code))

    def sval(attr: int, payload: bytes) -> bytes:
        return struct.pack("<BBH", 4, attr, len(payload)) + payload

    info = (
        sval(0x2F, struct.pack("<II", sym_index, registers))
        + sval(0x11, struct.pack("<II", sym_index, frame))
        + sval(0x12, struct.pack("<II", sym_index, stack))
    )
    kinfo = sval(0x37, struct.pack("<I", api_version))
    offset = 0
    for ordinal in reversed(range(len(param_sizes))):  # ptxas lists them last first
        offset = sum(param_sizes[:ordinal])
        bits = (param_sizes[ordinal] << 18) | 0x1F000
        kinfo += sval(0x17, struct.pack("<IHHI", 0, ordinal, offset, bits))
    kinfo += struct.pack("<BBH", 3, 0x1B, 255)  # EIATTR_MAXREG_COUNT (HVAL)
    kinfo += sval(0x10, struct.pack("<III", *block))
    kinfo += struct.pack("<BBH", 3, 0x19, sum(param_sizes))  # EIATTR_CBANK_PARAM_SIZE

    blobs = [shstr, strtab, symtab, info, kinfo, code]
    data = bytearray(64)
    offsets = []
    for blob in blobs:
        while len(data) % 8:
            data.append(0)
        offsets.append(len(data))
        data += blob
    while len(data) % 8:
        data.append(0)
    shoff = len(data)
    # (name offset, type, flags, offset, size, link, info, align, entsize)
    sections = [(0, 0, 0, 0, 0, 0, 0, 0, 0)]
    types = [3, 3, 2, 0x70000000, 0x70000000, 1]
    links = [0, 0, 2, 3, 3, 0]
    for i, blob in enumerate(blobs):
        name_off = shstr.index(names[i].encode() + b"\0")
        entsize = 24 if i == 2 else 0
        sections.append((name_off, types[i], 0, offsets[i], len(blob), links[i], 0, 8, entsize))
    smem_name = shstr.index(names[6].encode() + b"\0")
    sections.append((smem_name, 8, 3, shoff, static_smem, 0, text_index, 16, 0))  # NOBITS
    for name_off, typ, fl, off, size, link, inf, align, ent in sections:
        data += struct.pack("<IIQQQQIIQQ", name_off, typ, fl, 0, off, size, link, inf, align, ent)
    ident = b"\x7fELF" + bytes([2, 1, 1, osabi, abi]) + bytes(7)
    header = struct.pack("<16sHHIQQQIHHHHHH", ident, 2, 190, api_version, 0, 0, shoff, flags,
                         64, 56, 0, 64, len(sections), 1)  # fmt: skip
    data[:64] = header
    return bytes(data)

"""Read what a cubin says about itself, in pure Python (no CUDA tools needed).

A cubin is a 64-bit little-endian ELF file. ptxas records per-kernel facts in
``.nv.info`` sections as a sequence of attributes, each a 4-byte header
``(format: u8, attribute: u8, value_or_size: u16)`` followed, for the
``EIFMT_SVAL`` format, by ``size`` payload bytes. The attribute codes used here
were checked against ``cuobjdump -elf`` of cubins from nvidia-cutlass-dsl
4.8.1 (ptxas 12.9); ``tests/test_pipeline_elf.py`` repeats that check whenever
cuobjdump is installed.

Facts read:
- the ELF ``e_version`` word and ``EIATTR_CUDA_API_VERSION``: the CUDA version
  of the toolchain that assembled the cubin (``129`` = 12.9);
- the SM architecture from ``e_flags`` (layout per ELF ABI version, see
  ``_arch``);
- per kernel: registers (``EIATTR_REGCOUNT``), local memory frame bytes per
  thread (``EIATTR_FRAME_SIZE``), stack bytes (``EIATTR_MIN/MAX_STACK_SIZE``),
  the parameter layout (``EIATTR_KPARAM_INFO``: ordinal, offset, size),
  ``.reqntid`` (``EIATTR_REQNTID``), a register cap (``EIATTR_MAXREG_COUNT``)
  and static shared memory (the size of the ``.nv.shared.<kernel>`` section,
  which is what ``cuobjdump --dump-resource-usage`` reports as SHARED; the
  ``.nv.shared.reserved.*`` sections are not counted, as cuobjdump does not);
- the ptxas version string from the ``.note.nv.tkinfo`` note when the cubin
  has one (ELF ABI 8, e.g. sm_100a: ``12.9.83``); ABI 7 cubins (sm_90a) carry
  only the CUDA API version (``12.9``).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

# ELF constants
_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_EM_CUDA = 190
_SHT_SYMTAB = 2
_STT_FUNC = 2

# .nv.info attribute formats
_EIFMT_NVAL = 1  # no value
_EIFMT_BVAL = 2  # byte value in the 16-bit field
_EIFMT_HVAL = 3  # 16-bit value in the header
_EIFMT_SVAL = 4  # sized payload follows

# .nv.info attribute codes (as cuobjdump names them)
EIATTR_PARAM_CBANK = 0x0A
EIATTR_REQNTID = 0x10
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_KPARAM_INFO = 0x17
EIATTR_CBANK_PARAM_SIZE = 0x19
EIATTR_MAXREG_COUNT = 0x1B
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
EIATTR_CUDA_API_VERSION = 0x37


class CubinError(ValueError):
    """The bytes are not a cubin this reader understands (message says why)."""


@dataclass(frozen=True)
class KernelParam:
    """One entry parameter as ptxas laid it out in the parameter bank."""

    ordinal: int
    offset: int  # bytes from the start of the parameter block
    size: int  # bytes


@dataclass
class KernelInfo:
    """Resource facts of one ``.entry`` of a cubin."""

    name: str
    registers: int = 0
    frame_bytes: int = 0  # local memory per thread (spills + local arrays)
    min_stack_bytes: int = 0
    max_stack_bytes: int = 0
    static_smem: int = 0  # bytes of .shared declared by the kernel
    reqntid: tuple[int, ...] | None = None
    maxreg: int | None = None
    param_bytes: int | None = None
    params: list[KernelParam] = field(default_factory=list)


@dataclass
class CubinInfo:
    """What one cubin says about itself."""

    arch: str  # e.g. "sm_90a"
    toolkit: int  # CUDA version of the assembler, 10 * major + minor (129 = 12.9)
    kernels: dict[str, KernelInfo]
    #: Full ptxas version from .note.nv.tkinfo ("12.9.83"), or None without the note.
    ptxas: str | None = None

    @property
    def toolkit_version(self) -> str:
        """``"12.9"`` for toolkit 129."""
        return f"{self.toolkit // 10}.{self.toolkit % 10}"

    @property
    def ptxas_version(self) -> str:
        """The most precise assembler version the cubin records."""
        return self.ptxas or self.toolkit_version


@dataclass(frozen=True)
class _Section:
    name: str
    type: int
    flags: int
    offset: int
    size: int
    link: int
    info: int
    entsize: int


def read_cubin(data: bytes) -> CubinInfo:
    """Parses a cubin; raises CubinError on anything that is not one."""
    if len(data) < 64 or data[:4] != _ELF_MAGIC:
        raise CubinError("not an ELF file (bad magic)")
    if data[4] != _ELFCLASS64 or data[5] != _ELFDATA2LSB:
        raise CubinError("not a 64-bit little-endian ELF file")
    try:
        return _read(data)
    except struct.error as exc:
        raise CubinError(f"truncated or malformed ELF: {exc}") from None


def _read(data: bytes) -> CubinInfo:
    (ident, _, machine, version, _, _, shoff, flags, _, _, _, shentsize, shnum, shstrndx) = (
        struct.unpack_from("<16sHHIQQQIHHHHHH", data, 0)
    )
    if machine != _EM_CUDA:
        raise CubinError(f"ELF machine {machine} is not CUDA ({_EM_CUDA})")
    if shoff + shnum * shentsize > len(data):
        raise CubinError("section table runs past the end of the file")
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = raw[shstrndx]
    sections = [
        _Section(_cstr(data, strtab[4] + s[0]), s[1], s[2], s[4], s[5], s[6], s[7], s[9])
        for s in raw
    ]
    symbols = _symbols(data, sections)
    kernels = {
        sym: KernelInfo(sym)
        for sym, (kind, _) in symbols.items()
        if kind == _STT_FUNC and any(s.name == f".text.{sym}" for s in sections)
    }
    names_by_index = {index: sym for sym, (_, index) in symbols.items()}
    api_version = None
    for sec in sections:
        if sec.name == ".nv.info":
            _global_info(data, sec, names_by_index, kernels)
        elif sec.name.startswith(".nv.info."):
            kernel = kernels.get(sec.name[len(".nv.info.") :])
            if kernel is not None:
                api_version = _kernel_info(data, sec, kernel) or api_version
    for name, kernel in kernels.items():
        kernel.static_smem = sum(s.size for s in sections if s.name == f".nv.shared.{name}")
        kernel.params.sort(key=lambda p: p.ordinal)
    toolkit = api_version if api_version is not None else version
    ptxas = None
    for sec in sections:
        if sec.name == ".note.nv.tkinfo":
            found = _TKINFO_RE.search(data[sec.offset : sec.offset + sec.size])
            ptxas = found.group(1).decode() if found else None
    return CubinInfo(arch=_arch(ident[8], flags), toolkit=toolkit, kernels=kernels, ptxas=ptxas)


#: In .note.nv.tkinfo: "ptxas\0Cuda compilation tools, release 12.9, V12.9.83\0..."
_TKINFO_RE = re.compile(rb"ptxas\0Cuda compilation tools, release [0-9.]+, V([0-9.]+)\0")


def _cstr(data: bytes, offset: int) -> str:
    end = data.index(b"\0", offset)
    return data[offset:end].decode("ascii", "replace")


def _symbols(data: bytes, sections: list[_Section]) -> dict[str, tuple[int, int]]:
    """name -> (symbol type, symbol table index)."""
    out = {}
    for sec in sections:
        if sec.type != _SHT_SYMTAB:
            continue
        names = sections[sec.link]
        for i in range(sec.size // 24):
            st_name, st_info, _, _, _, _ = struct.unpack_from("<IBBHQQ", data, sec.offset + 24 * i)
            if st_name:
                out[_cstr(data, names.offset + st_name)] = (st_info & 0xF, i)
    return out


def _attributes(data: bytes, sec: _Section):
    """Yields (attribute, value or None, payload bytes) of one .nv.info section."""
    pos, end = sec.offset, sec.offset + sec.size
    while pos + 4 <= end:
        fmt, attr, word = struct.unpack_from("<BBH", data, pos)
        pos += 4
        if fmt == _EIFMT_SVAL:
            payload = data[pos : pos + word]
            if len(payload) != word:
                raise CubinError(f"{sec.name}: attribute 0x{attr:02x} runs past the section")
            pos += word
            yield attr, None, payload
        elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            yield attr, word, b""
        else:
            raise CubinError(f"{sec.name}: unknown attribute format {fmt}")


def _global_info(data, sec, names_by_index, kernels) -> None:
    """``.nv.info``: (symbol index, value) pairs per kernel."""
    fields = {
        EIATTR_REGCOUNT: "registers",
        EIATTR_FRAME_SIZE: "frame_bytes",
        EIATTR_MIN_STACK_SIZE: "min_stack_bytes",
        EIATTR_MAX_STACK_SIZE: "max_stack_bytes",
    }
    for attr, _, payload in _attributes(data, sec):
        if attr in fields and len(payload) == 8:
            index, value = struct.unpack("<II", payload)
            kernel = kernels.get(names_by_index.get(index, ""))
            if kernel is not None:
                setattr(kernel, fields[attr], value)


def _kernel_info(data, sec, kernel: KernelInfo) -> int | None:
    """``.nv.info.<kernel>``; returns EIATTR_CUDA_API_VERSION when present."""
    api_version = None
    for attr, value, payload in _attributes(data, sec):
        if attr == EIATTR_KPARAM_INFO and len(payload) == 12:
            _, ordinal, offset, bits = struct.unpack("<IHHI", payload)
            kernel.params.append(KernelParam(ordinal, offset, (bits >> 18) & 0x3FFF))
        elif attr == EIATTR_REQNTID and payload:
            kernel.reqntid = struct.unpack(f"<{len(payload) // 4}I", payload)
        elif attr == EIATTR_MAXREG_COUNT:
            kernel.maxreg = value
        elif attr == EIATTR_CBANK_PARAM_SIZE:
            kernel.param_bytes = value
        elif attr == EIATTR_CUDA_API_VERSION and len(payload) == 4:
            api_version = struct.unpack("<I", payload)[0]
    return api_version


def _arch(abi: int, flags: int) -> str:
    """``sm_XX[a]`` from e_flags. Two layouts (checked against cuobjdump):
    ELF ABI 7 (sm_90a: 0x5a0d5a) has the SM in bits 0..7 and the
    architecture-specific ``a`` bit at 0x800; ABI 8 (sm_100a: 0x600640a) has
    the SM in bits 8..15 and the ``a`` bit at 0x8."""
    if abi >= 8:
        sm, specific = (flags >> 8) & 0xFF, flags & 0x8
    else:
        sm, specific = flags & 0xFF, flags & 0x800
    return f"sm_{sm}{'a' if specific else ''}"

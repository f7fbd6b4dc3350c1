"""The pure-Python cubin reader: facts read back from ELF files laid out as
ptxas lays them out, and clear refusals of anything else. (Real DSL cubins
are checked against cuobjdump in tests/test_pipeline_dsl.py.)"""

from __future__ import annotations

import struct

import pytest
from pipeline_stub_kernel import make_cubin

from pipeline.elf import CubinError, read_cubin


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_reads_what_was_written(arch):
    cubin = make_cubin(arch, "moe_k_0", [8, 8, 4, 8], (160, 1, 1), b"\x01" * 96, registers=168,
                       frame=24, stack=16, static_smem=3072, api_version=129)  # fmt: skip
    info = read_cubin(cubin)
    assert info.arch == arch
    assert info.toolkit == 129 and info.toolkit_version == "12.9" and info.ptxas_version == "12.9"
    k = info.kernels["moe_k_0"]
    assert (k.registers, k.frame_bytes, k.min_stack_bytes, k.static_smem) == (168, 24, 16, 3072)
    assert k.reqntid == (160, 1, 1)
    assert [(p.ordinal, p.offset, p.size) for p in k.params] == [
        (0, 0, 8), (1, 8, 8), (2, 16, 4), (3, 20, 8)
    ]  # fmt: skip
    assert k.param_bytes == 28 and k.maxreg == 255


def test_toolkit_version_comes_from_the_cubin():
    info = read_cubin(make_cubin("sm_90a", "k", [8], (32, 1, 1), b"\0" * 16, api_version=130))
    assert info.toolkit_version == "13.0"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b"MZ" + b[2:], "bad magic"),
        (lambda b: b[:4] + b"\x01" + b[5:], "not a 64-bit little-endian"),
        (lambda b: b[:18] + struct.pack("<H", 62) + b[20:], "is not CUDA"),
        (lambda b: b[:100], "section table runs past"),
        (lambda b: b"", "bad magic"),
    ],
)
def test_refuses_what_is_not_a_cubin(mutate, message):
    cubin = make_cubin("sm_90a", "k", [8], (32, 1, 1), b"\0" * 16)
    with pytest.raises(CubinError, match=message):
        read_cubin(mutate(cubin))


def test_truncated_attribute_is_refused():
    cubin = bytearray(make_cubin("sm_90a", "k", [8], (32, 1, 1), b"\0" * 16))
    # Grow the size field of the first attribute of .nv.info.k past its section.
    at = bytes(cubin).index(struct.pack("<BBH", 4, 0x37, 4))
    cubin[at + 2 : at + 4] = struct.pack("<H", 4000)
    with pytest.raises(CubinError, match="runs past the section"):
        read_cubin(bytes(cubin))

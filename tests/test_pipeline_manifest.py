"""pipeline.manifest.variant_record's ABI check against the cubin: the
declared launch block must equal the cubin's ``.reqntid`` (a kernel launched
with another block size fails to launch, or runs with threads it was not
compiled for), and the other declared facts (arch, entry, parameter count and
sizes) must match the cubin too. Cubins from tests/pipeline_stub_kernel.py."""

from __future__ import annotations

import struct

import pytest
from pipeline_stub_kernel import compile_kernel, make_cubin

from kernels.spec import KernelSpec
from pipeline.manifest import ManifestError, compress, variant_record
from pipeline.variants import Variant
from pipeline.worker import result_to_dict

VARIANT = Variant("grouped", "sm_90a", 8, "float32", False, 132)
SPEC = KernelSpec("grouped", "sm_90a", 256, 256, 32, 4, 2.5, 10.0, False, 8, "float32", False, 132)


def _result(block=(128, 1, 1), reqntid=(128, 1, 1), arch="sm_90a", entry=None):
    """The stub's compile result with its cubin rebuilt: ``reqntid`` in the
    cubin (None: the attribute left out), ``block`` in the declared launch."""
    result = result_to_dict(compile_kernel(SPEC))
    entry = entry or result["entry"]
    cubin = make_cubin(arch, entry, [8, 8, 4], reqntid or (1, 1, 1), b"\x01" * 64)
    if reqntid is None:
        cubin = _drop_reqntid(cubin)
    result["cubin"] = cubin
    result["launch"]["block"] = list(block)
    return result


def _drop_reqntid(cubin: bytes) -> bytes:
    """The cubin with its EIATTR_REQNTID record turned into an unknown
    attribute (same size, so every offset stays)."""
    record = struct.pack("<BBH", 4, 0x10, 12) + struct.pack("<III", 1, 1, 1)
    at = cubin.index(record)
    return cubin[:at] + struct.pack("<BBH", 4, 0x7E, 12) + cubin[at + 4 :]


def _record(result):
    return variant_record(VARIANT, result, "0" * 64, compress(result["cubin"]))


def test_matching_block_is_recorded():
    rec = _record(_result())
    assert rec["launch"]["block"] == [128, 1, 1]
    assert rec["name"] == VARIANT.name and [p["size"] for p in rec["params"]] == [8, 8, 4]


@pytest.mark.parametrize(
    "block, reqntid",
    [((256, 1, 1), (128, 1, 1)), ((128, 1, 1), (384, 1, 1)), ((128, 2, 1), (128, 1, 1)),
     ((64, 2, 1), (128, 1, 1))],
)  # fmt: skip
def test_block_other_than_reqntid_is_refused(block, reqntid):
    with pytest.raises(ManifestError, match=r"launch block .* differs from the cubin's \.reqntid"):
        _record(_result(block=block, reqntid=reqntid))


def test_cubin_without_reqntid_takes_any_block():
    from pipeline.elf import read_cubin

    result = _result(block=(256, 1, 1), reqntid=None)
    assert read_cubin(result["cubin"]).kernels[result["entry"]].reqntid is None
    assert _record(result)["launch"]["block"] == [256, 1, 1]


def test_other_abi_mismatches_are_refused():
    with pytest.raises(ManifestError, match=r"the cubin is for sm_100a, expected sm_90a"):
        _record(_result(arch="sm_100a"))
    with pytest.raises(ManifestError, match=r"entry 'stub_grouped_sm_90a_0' is not a kernel"):
        _record(_result(entry="other_0"))
    result = _result()
    result["params"].append({"name": "extra", "kind": "pointer"})
    with pytest.raises(ManifestError, match=r"4 parameters declared, the cubin's entry takes 3"):
        _record(result)
    result = _result()
    result["params"][2]["kind"] = "pointer"  # the cubin's third parameter has 4 bytes
    with pytest.raises(ManifestError, match=r"parameter 2 'count' \(pointer\) expects 8 bytes"):
        _record(result)

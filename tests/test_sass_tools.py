"""The SASS control-flow walk of ``sass_tools.unwaited_loads`` (what the
compile tests hold every kernel to: no global load before the PDL wait on
any path), on hand-written listings in cuobjdump's format."""

import pytest
from sass_tools import unwaited_loads


def listing(*lines: str) -> str:
    """cuobjdump-style SASS: one instruction a 16-byte slot from 0x0000."""
    return "\n".join(
        f"        /*{16 * i:04x}*/                   {line} ;" for i, line in enumerate(lines)
    )


def test_a_load_after_the_wait_on_every_path_passes():
    sass = listing(
        "ACQBULK",
        "@P0 BRA 0x40",
        "LDG.E.CONSTANT R0, desc[UR4][R2.64]",
        "BRA 0x50",
        "LDG.E R1, desc[UR4][R2.64+0x4]",
        "EXIT",
    )
    assert unwaited_loads(sass) == []


def test_a_branch_around_the_wait_reaches_the_load():
    """A path that jumps past the wait (the shape ptxas left when it hoisted
    the routing's ``ld.global.nc`` to where a waited and an unwaited path
    meet) is reported, though the load also follows the wait in text."""
    sass = listing(
        "@P0 BRA 0x30",
        "ACQBULK",
        "BRA 0x30",
        "LDG.E.CONSTANT R0, desc[UR4][R2.64]",
        "EXIT",
    )
    assert unwaited_loads(sass) == ["0030 LDG.E.CONSTANT R0, desc[UR4][R2.64]"]


def test_exits_predicated_waits_calls_and_cp_async():
    # An unpredicated EXIT ends the path; a predicated one does not.
    ended = listing("EXIT", "LDG.E R0, desc[UR4][R2.64]")
    assert unwaited_loads(ended) == []
    going = listing("@P1 EXIT", "LDGSTS.E [R4], desc[UR4][R2.64]", "EXIT")
    assert unwaited_loads(going) == ["0010 LDGSTS.E [R4], desc[UR4][R2.64]"]
    # A predicated wait may not run; a load in a callee counts on its caller's path.
    sass = listing("@P2 ACQBULK", "CALL.REL.NOINC 0x30", "EXIT", "LD.E R0, [R2.64]", "RET.REL R20")
    assert unwaited_loads(sass) == ["0030 LD.E R0, [R2.64]"]
    # BRA.DIV may fall through as well as jump.
    div = listing("BRA.DIV UR6, 0x30", "LDG.E R0, desc[UR4][R2.64]", "EXIT", "ACQBULK", "EXIT")
    assert unwaited_loads(div) == ["0010 LDG.E R0, desc[UR4][R2.64]"]


def test_indirect_jumps_fail_the_walk():
    with pytest.raises(AssertionError):
        unwaited_loads(listing("BRX R4 -0x10", "EXIT"))

"""The mutation table (tests/mutations.py) still applies to the code: each
mistake's text occurs exactly once in its file and names tests that exist;
and making each mistake in a scratch copy of the tree fails its tests."""

from __future__ import annotations

import pytest
from mutations import MUTATIONS, ROOT, main


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_once(m):
    text = (ROOT / m.path).read_text()
    assert text.count(m.old) == 1, f"{m.path}: {m.old!r} occurs {text.count(m.old)} times"
    assert m.new != m.old
    for node in m.tests:
        path, _, name = node.partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(), node


def test_every_mutation_is_caught(capsys):
    rc = main([])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out

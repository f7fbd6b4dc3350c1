"""runtime.plan: bucket choice, the default dispatch table and padding."""

from __future__ import annotations

import pytest
import seeding
import torch

from runtime.plan import Step, bucket_for, default_table, pad_rows, padding
from runtime.reference import route

GLM5 = {
    "mega": {m: {False} for m in (1, 2, 3, 4)},
    "grouped": {m: {False, True} for m in (8, 16, 32, 48, 64)},
}


def test_bucket_is_exact_else_next_above():
    buckets = (8, 16, 32, 48, 64)
    assert bucket_for(16, buckets) == 16
    assert bucket_for(5, buckets) == 8
    assert bucket_for(33, buckets) == 48
    assert bucket_for(65, buckets) is None


def test_default_table_glm5():
    table = default_table(GLM5)
    assert sorted(table) == list(range(1, 65))
    for m in range(1, 5):
        assert table[m] == Step("mega", m)
    expected = {5: 8, 8: 8, 9: 16, 17: 32, 32: 32, 33: 48, 49: 64, 64: 64}
    for m, bucket in expected.items():
        assert table[m] == Step("grouped", bucket, finalize=True)


def test_default_table_without_final_or_mega():
    table = default_table({"grouped": {m: {False} for m in (16, 64)}})
    assert table[1] == Step("grouped", 16, finalize=False)
    assert table[17] == Step("grouped", 64, finalize=False)
    assert default_table({"mega": {2: {False}}}) == {1: Step("mega", 2), 2: Step("mega", 2)}


def test_pad_rows_repeats_the_last_row():
    x = torch.randn(5, 7, generator=seeding.generator())
    padded = pad_rows(x, 8)
    assert padded.shape == (8, 7) and padded.is_contiguous()
    assert torch.equal(padded[:5], x)
    assert torch.equal(padded[5:], x[-1:].expand(3, 7))
    assert pad_rows(x, 5) is x
    with pytest.raises(ValueError):
        padding(9, 8)


def test_padding_touches_no_further_expert():
    gen = seeding.generator()
    m, experts = 5, 288
    logits = torch.randn(m, experts, generator=gen)
    bias = torch.randn(experts, generator=gen) * 0.1
    ids, _ = route(logits, bias, 8, 2.5)
    padded_ids, _ = route(pad_rows(logits, 8), bias, 8, 2.5)
    assert torch.equal(padded_ids[:m], ids)
    assert set(padded_ids.view(-1).tolist()) == set(ids.view(-1).tolist())

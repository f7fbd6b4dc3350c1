"""Tensor-parallel shards: the sum of the shards' reference outputs is the
unsharded layer's, and bad splits are refused."""

import pytest
import seeding
import torch

from runtime.layout import random_checkpoint
from runtime.model import MoEShape
from runtime.reference import moe_reference
from runtime.sharding import shard_shape, split_checkpoint

FULL = MoEShape(
    hidden=256, inter=512, experts=32, top_k=4, routed_scale=2.5, swiglu_limit=10.0,
    ue8m0=False, shared_experts=1,
)  # fmt: skip


def test_shard_outputs_sum_to_the_full_layer():
    g = seeding.generator()
    routed = random_checkpoint(FULL.experts, FULL.hidden, FULL.inter, g)
    shared = random_checkpoint(1, FULL.hidden, FULL.inter, g)
    x = torch.randn(5, FULL.hidden, generator=g).bfloat16()
    logits = torch.randn(5, FULL.experts, generator=g)
    bias = torch.randn(FULL.experts, generator=g) * 0.1
    full = moe_reference(x, logits, bias, routed, shared, FULL, torch.float64)
    part = shard_shape(FULL, 4)
    assert part.inter == 128
    total_out = torch.zeros_like(full.out)
    total_final = torch.zeros_like(full.final)
    for r, s in zip(split_checkpoint(routed, 4), split_checkpoint(shared, 4), strict=True):
        ref = moe_reference(x, logits, bias, r, s, part, torch.float64)
        assert torch.equal(ref.ids, full.ids)
        total_out += ref.out
        total_final += ref.final
    # Exact up to float64 summation order.
    assert torch.allclose(total_out, full.out, rtol=1e-12, atol=1e-12)
    assert torch.allclose(total_final, full.final, rtol=1e-12, atol=1e-12)


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="shards"):
        shard_shape(FULL, 3)
    g = torch.Generator().manual_seed(0)
    ckpt = random_checkpoint(2, 256, 256, g)
    with pytest.raises(ValueError, match="shards"):
        split_checkpoint(ckpt, 4)  # 64-column shards would split 128-blocks

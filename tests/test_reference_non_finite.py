"""What the kernels must match for non-finite inputs: a NaN or Inf in a
token's x, or a NaN in its logits, makes that token's output row non-finite
(in float32 and float64 mode); the other tokens' rows are those of a call
without the bad tokens."""

from __future__ import annotations

import runtime_fixtures as fx
import seeding
import torch

from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.reference import moe_reference


def test_non_finite_tokens_give_non_finite_rows_and_leave_the_others():
    shape = MoEShape(**fx.SMALL_MODEL)
    g = seeding.generator()
    _, routed, shared = random_moe_weights(shape, g)
    x = torch.randn(5, shape.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(5, shape.experts, generator=g)
    bias = torch.randn(shape.experts, generator=g) * 0.1
    x[0, 3] = float("nan")
    x[1, 7] = float("inf")
    logits[2, 1] = float("nan")
    for dtype in (torch.float32, torch.float64):
        got = moe_reference(x, logits, bias, routed, shared, shape, dtype=dtype).final
        for t in range(3):
            assert not torch.isfinite(got[t]).any(), (dtype, t, seeding.rerun_hint())
        clean = moe_reference(x[3:], logits[3:], bias, routed, shared, shape, dtype=dtype).final
        assert torch.equal(got[3:], clean), (dtype, seeding.rerun_hint())

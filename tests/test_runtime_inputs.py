"""runtime.inputs: a call's tensors and a weight set are refused with messages
that name the argument, the expectation and what was found."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import seeding
import torch

from runtime.constants import MAX_TOKENS
from runtime.errors import InputError
from runtime.inputs import check_call, check_weights
from runtime.layout import MoEWeights, random_moe_weights
from runtime.model import MoEShape

SHAPE = MoEShape(**fx.SMALL_MODEL)
CPU = torch.device("cpu")
BOTH = ("float32", "bfloat16")


def _call(m=3, logits_dtype=torch.float32):
    g = seeding.generator()
    x = torch.randn(m, SHAPE.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(m, SHAPE.experts, generator=g).to(logits_dtype)
    bias = torch.randn(SHAPE.experts, generator=g)
    return x, logits, bias


def test_accepts_a_good_call():
    for dtype in (torch.float32, torch.bfloat16):
        assert check_call(*_call(5, dtype), SHAPE, CPU, BOTH) == 5


@pytest.mark.parametrize("m", [0, MAX_TOKENS + 1])
def test_refuses_m_out_of_range(m):
    with pytest.raises(InputError, match=rf"expected M \(tokens\) in 1..{MAX_TOKENS}, found {m}"):
        check_call(*_call(m), SHAPE, CPU, BOTH)


def _misaligned(m, h):
    return torch.empty(m * h + 1, dtype=torch.bfloat16)[1:].view(m, h)


@pytest.mark.parametrize(
    "which, make, pattern",
    [
        ("x", lambda x: x.float(), r"x: expected dtype torch.bfloat16, found torch.float32"),
        ("x", lambda x: x[:, :-128], r"x: expected shape \[3, 256\], found \[3, 128\]"),
        ("x", lambda x: x.t().contiguous().t(), r"x: expected a contiguous tensor"),
        ("x", lambda x: _misaligned(*x.shape), r"x: expected a 16-byte aligned address"),
        ("x", lambda x: x.to("meta"), r"x: expected device cpu, found meta"),
        ("x", lambda x: x[0], r"x: expected a \[M, 256\] tensor, found \[256\]"),
        ("logits", lambda t: t.half(), r"logits: expected dtype torch.float32 or torch.bfloat16"),
        ("logits", lambda t: t[:2], r"logits: expected shape \[3, 32\], found \[2, 32\]"),
        ("bias", lambda t: t.to(torch.bfloat16), r"bias: expected dtype torch.float32"),
        ("bias", lambda t: t[None], r"bias: expected shape \[32\], found \[1, 32\]"),
        ("bias", lambda t: t.numpy(), r"bias: expected a torch.Tensor, found ndarray"),
    ],
)
def test_refuses_bad_tensors(which, make, pattern):
    args = dict(zip(("x", "logits", "bias"), _call(), strict=True))
    args[which] = make(args[which])
    with pytest.raises(InputError, match=pattern):
        check_call(args["x"], args["logits"], args["bias"], SHAPE, CPU, BOTH)


def test_refuses_a_logits_dtype_no_variant_serves():
    with pytest.raises(InputError, match="logits: expected dtype torch.float32, found torch.bf"):
        check_call(*_call(2, torch.bfloat16), SHAPE, CPU, ("float32",))


@pytest.fixture(scope="module")
def weights():
    return random_moe_weights(SHAPE, torch.Generator().manual_seed(7))[0]


def test_weights_give_every_kernel_tensor(weights):
    tensors = check_weights(weights, SHAPE, CPU)
    assert sorted(tensors) == sorted(
        ["w13", "w13_scale", "w2", "w2_scale", "s13", "s13_scale", "s2", "s2_scale"]
    )
    assert tensors["s2"] is weights.shared.w2


def test_refuses_bad_weights(weights):
    wrong = MoEWeights(weights.routed, None)
    with pytest.raises(InputError, match="weights.shared: the config has a shared expert"):
        check_weights(wrong, SHAPE, CPU)
    bad = weights.routed.__class__(
        weights.routed.w13.view(torch.uint8), *weights.routed.tensors()[1:]
    )
    with pytest.raises(InputError, match=r"weights.routed.w13: expected dtype torch.float8_e4m3fn"):
        check_weights(MoEWeights(bad, weights.shared), SHAPE, CPU)
    other = MoEShape(**{**fx.SMALL_MODEL, "experts": 64})
    with pytest.raises(InputError, match=r"weights.routed.w13: expected shape \[64, 2, 256, 128\]"):
        check_weights(weights, other, CPU)
    with pytest.raises(InputError, match="expected a runtime.layout.MoEWeights"):
        check_weights({"w13": None}, SHAPE, CPU)


def test_bias_is_none_exactly_for_a_model_without_one():
    """A model routing without a score-correction bias (Qwen3) takes None:
    its kernels never read one, so a tensor would go silently unused; a
    model with one refuses None. The fast path (a second call) agrees."""
    import dataclasses

    plain = dataclasses.replace(SHAPE, bias=False, score="softmax")
    x, logits, bias = _call(4)
    for _ in range(2):
        assert check_call(x, logits, None, plain, CPU, BOTH) == 4
        assert check_call(x, logits, bias, SHAPE, CPU, BOTH) == 4
        with pytest.raises(InputError, match=r"bias: this model routes without .*pass None"):
            check_call(x, logits, bias, plain, CPU, BOTH)
        with pytest.raises(InputError, match=r"bias: this model routes with .*found None"):
            check_call(x, logits, None, SHAPE, CPU, BOTH)

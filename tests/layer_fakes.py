"""Stand-ins for CPU tests of the bound layer (runtime.moe): variant records
of each mega ABI, an artifact that launches nothing, and ``TaggedLayer``,
the real ``MoELayer`` whose launch writes ``tags`` (exact per-token functions
of its inputs) instead of running a kernel, so every output the layer
returns can be predicted from the caller's rows; and ``ReferenceLayer``, the
layer's entries computed by the float32 reference, for tests of code that
checks a layer (the benchmark, tests/gpu/test_models_gpu.py)."""

from __future__ import annotations

import runtime_fixtures as fx
import torch

from kernels import abi
from runtime.artifact import Launch, Variant, WorkspaceNeed
from runtime.model import MoEShape
from runtime.moe import MoELayer, _Block, computes_shared, takes_valid, writes_final
from runtime.plan import pad_rows

SHAPE = MoEShape(**fx.SMALL_MODEL)


#: The mega kernel's routed-only ABI (kernels/abi.py); fx.record's default
#: is the ABI with the shared expert and the in-kernel finalize.
MEGA_ROUTED = {
    "params": [{"name": p, "kind": "pointer"} for p in abi.MEGA_ROUTED_PARAMS],
    "tensor_maps": list(abi.MEGA_ROUTED_MAPS),
}
#: The mega ABI of artifacts built before the in-kernel finalize: shared rows
#: but no ``final`` (the layer sums the routes in torch).
MEGA_NO_FINAL = {
    "params": [{"name": p, "kind": "pointer"} for p in abi.MEGA_PARAMS
               if p not in ("final", "arrivals")],
    "tensor_maps": list(abi.MEGA_MAPS), "workspace": [],
}  # fmt: skip


def variant(kernel, tokens, dtype, finalize=False, shared=True, final=True):
    """A variant record; mega ones with the shared expert unless ``shared``
    is False (the older routed-only ABI) and with the in-kernel finalize
    unless ``final`` is False."""
    extra = {}
    if kernel == "mega":
        extra = MEGA_ROUTED if not shared else ({} if final else MEGA_NO_FINAL)
    rec = fx.record(kernel, tokens=tokens, dtype=dtype, finalize=finalize, **extra)
    return Variant(
        name=rec["name"], kernel=kernel, arch="sm_90a", tokens=tokens, logits_dtype=dtype,
        finalize=finalize, sms=132, entry=rec["entry"],
        params=tuple((p["name"], p["kind"]) for p in rec["params"]),
        tensor_maps=tuple(rec["tensor_maps"]), launch=Launch((1, 1, 1), (1, 1, 1), None, 0, False),
        workspace=tuple(WorkspaceNeed(w["name"], w["bytes"], w["zero"]) for w in rec["workspace"]),
        sha256="0" * 64, cubin=b"",
    )  # fmt: skip


class FakeArtifact:
    arch = "sm_90a"

    def __init__(self, variants):
        self.variants = variants

    def launcher(self, variant, ordinal):
        return None

    def tensor_maps(self, tensors, names, device):
        return torch.zeros(128 * len(names), dtype=torch.uint8)


def tags(x, logits, top_k):
    """What the stand-in kernel writes for tokens ``x`` [T, H] (BF16) and
    ``logits`` [T, E]: simple functions of each token's own row, chosen so
    that every sum the layer takes of them is exact in FP32.

    ids [T, k]: the token's top-k logits, best first; weights [T, k]: those
    logits rounded to eighths; out row t*k + j: x[t] * 2^-j; shared row t:
    -x[t] / 2; final [T, H]: sum_j weights * out + shared, rounded once to
    BF16."""
    ids = torch.topk(logits.float(), top_k, dim=-1).indices
    weights = torch.round(logits.float().gather(1, ids) * 8) / 8
    steps = 2.0 ** -torch.arange(top_k, dtype=torch.float32)
    out = (x.float()[:, None, :] * steps[None, :, None]).reshape(-1, x.shape[1])
    shared = -x.float() / 2
    coeff = (weights.double() * steps.double()).sum(-1, keepdim=True)  # [T, 1]
    routed = x.double() * coeff
    return {
        "ids": ids.to(torch.int32), "weights": weights, "out": out.to(torch.bfloat16),
        "shared": shared.to(torch.bfloat16), "routed": routed,
        "final": (routed + shared.double()).to(torch.bfloat16),
    }  # fmt: skip


class TaggedLayer(MoELayer):
    """The layer with its launch replaced by a stand-in kernel writing
    ``tags`` of the padded bucket's inputs (padding itself, as the kernel
    does, for a variant that takes ``valid``; mega variants without
    ``shared_out`` leave it unwritten, as the kernel does; ``skip``: outputs
    left unwritten). No MoE math: what the layer returns can be predicted
    exactly from the caller's (unpadded) inputs."""

    def __init__(self, *args, skip=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.skip, self.calls, self.direct = skip, [], []
        #: (variant, rows of x it was handed) per launch: fewer than the
        #: bucket only for a variant that ``takes_valid``.
        self.given = []

    def _launch(self, variant, x, logits, bias, block, scratch=False):
        bucket, given = variant.tokens, x.shape[0]
        self.given.append((variant.name, given))
        if takes_valid(variant):  # the kernel's rows past ``valid`` repeat its last
            assert 1 <= x.shape[0] <= bucket and logits.shape[0] == x.shape[0]
            x, logits = pad_rows(x, bucket), pad_rows(logits, bucket)
        assert x.shape[0] == bucket and logits.shape[0] == bucket
        self.calls.append((variant.name, x.clone(), logits.clone()))
        t = tags(x, logits, SHAPE.top_k)
        results = {"out": t["out"], "ids": t["ids"], "weights": t["weights"]}
        if computes_shared(variant):
            results["shared_out"] = t["shared"]
        if writes_final(variant):
            results["final"] = t["final"]
        layout = self.layouts[variant.name]
        for name, value in results.items():
            # With ``scratch`` the call's block holds only ``final`` (the other
            # outputs go to the stream's scratch, which nobody reads back).
            if name not in self.skip and (name == "final" or not scratch):
                # A variant that takes ``valid`` writes only the call's rows
                # of ``final`` (which may hold only those).
                target = layout.view(block, name)
                if name == "final" and takes_valid(variant):
                    target, value = target[:given], value[:given]
                target.copy_(value)

    def _launch_rows(self, variant, x, logits, bias, out, starts, rows):
        # What the kernel does at each start's addresses, as tensors: the
        # chunk's rows in (padded as the kernel does where it takes
        # ``valid``), ``final`` into the same rows of ``out``.
        self.direct.append((variant.name, list(starts)))
        for s in starts:
            block = _Block(None, out[s : s + rows])
            self._launch(variant, x[s : s + rows], logits[s : s + rows], bias, block, True)


class ReferenceLayer:
    """Stands in for a bound layer (``mega``, ``grouped``, the call,
    ``dtypes``, ``device``): the float32 reference of ``shape``, outputs
    BF16-rounded. As runtime.moe's layer, it refuses a bias for a model
    without one (and None for one with one); for a model without a shared
    expert ``mega(..., shared=True)`` and ``grouped`` give None for the
    shared rows."""

    def __init__(self, routed, shared, shape, dtypes=("float32", "bfloat16"), device="cpu"):
        self.args = (routed, shared, shape)
        self.dtypes, self.device = tuple(dtypes), torch.device(device)

    def _ref(self, x, logits, bias):
        from runtime.reference import moe_reference

        shape = self.args[2]
        assert (bias is not None) == shape.bias, (bias, shape.bias)
        return moe_reference(x, logits, bias, *self.args)

    def mega(self, x, logits, bias, shared=False):
        r = self._ref(x, logits, bias)
        out = (r.out.bfloat16(), r.ids, r.weights)
        if not shared:
            return out
        return (*out, None if r.shared is None else r.shared.bfloat16())

    def grouped(self, x, logits, bias, finalize=False):
        r = self._ref(x, logits, bias)
        if finalize:
            return r.final.bfloat16()
        # Without a shared expert there are no shared rows (as runtime.moe).
        rows = None if r.shared is None else r.shared.bfloat16()
        return r.out.bfloat16(), r.ids, r.weights, rows

    def __call__(self, x, logits, bias):
        return self._ref(x, logits, bias).final.bfloat16()

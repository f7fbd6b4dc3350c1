"""runtime.checkpoint on small synthetic FP8 block-scale checkpoints (hidden
256, inter 256, 6 experts and a shared one; safetensors files with an index
over 2 shards, plus a dense layer, another MoE layer and unrelated tensors),
written from random checkpoint-layout experts and read back per rank: the
result equals runtime.layout.prepare of the same tensors sliced by hand and
by runtime.sharding.split_checkpoint, bit for bit."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import seeding
import torch

pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

import runtime.checkpoint as ck  # noqa: E402
from runtime.checkpoint import DEEPSEEK_V3, CheckpointError, Names, load_layer, read_layer  # noqa: E402
from runtime.layout import CheckpointWeights, ExpertWeights, prepare, random_checkpoint  # noqa: E402
from runtime.model import MoEShape  # noqa: E402
from runtime.sharding import split_checkpoint  # noqa: E402

H, I, E, LAYER = 256, 256, 6, 3
FP8 = torch.float8_e4m3fn
SHAPE2 = MoEShape(hidden=H, inter=I // 2, experts=E, top_k=2, routed_scale=1.0,
                  swiglu_limit=10.0, ue8m0=False, shared_experts=1)  # fmt: skip


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _same_experts(a, b) -> bool:
    return all(_same(getattr(a, f), getattr(b, f)) for f in ("w13", "w13_scale", "w2", "w2_scale"))


def _hf(ckpt: CheckpointWeights, prefix) -> dict:
    """Checkpoint-layout experts -> HF tensors: ``prefix(e)`` is expert e's
    module prefix (gate/up/down projections with FP8 weight and FP32
    weight_scale_inv)."""
    out = {}
    for e in range(ckpt.w13.shape[0]):
        halves = {"gate_proj": slice(0, I), "up_proj": slice(I, 2 * I)}
        for proj, rows in halves.items():
            blocks = slice(rows.start // 128, rows.stop // 128)
            out[f"{prefix(e)}.{proj}.weight"] = ckpt.w13[e, rows].contiguous()
            out[f"{prefix(e)}.{proj}.weight_scale_inv"] = ckpt.w13_scale[e, blocks].contiguous()
        out[f"{prefix(e)}.down_proj.weight"] = ckpt.w2[e].contiguous()
        out[f"{prefix(e)}.down_proj.weight_scale_inv"] = ckpt.w2_scale[e].contiguous()
    return out


def _layer_tensors(layer: int, g: torch.Generator):
    routed = random_checkpoint(E, H, I, g)
    shared = random_checkpoint(1, H, I, g)
    bias = torch.randn(E, generator=g) * 0.1
    tensors = _hf(routed, lambda e: f"model.layers.{layer}.mlp.experts.{e}")
    tensors |= _hf(shared, lambda e: f"model.layers.{layer}.mlp.shared_experts")
    tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = bias
    tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(E, H, generator=g).bfloat16()
    return routed, shared, bias, tensors


def _unrelated(g) -> dict:
    return {
        "model.embed_tokens.weight": torch.randn(64, H, generator=g).bfloat16(),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(I, H, generator=g).to(FP8),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(H, H, generator=g).bfloat16(),
        "lm_head.weight": torch.randn(64, H, generator=g).bfloat16(),
    }


def _write(root, tensors: dict, shards: int = 2):
    """``tensors`` as ``shards`` files (names dealt round-robin) with an
    index, or one model.safetensors when ``shards`` is 1."""
    root.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
        return root
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(root / file))
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(root, routed, shared, bias, tensors) of layer LAYER in a 2-shard checkpoint
    that also holds layer 4 (other values), a dense layer 0 and others."""
    g = seeding.generator(f"{__name__}.model")
    routed, shared, bias, tensors = _layer_tensors(LAYER, g)
    other = _layer_tensors(LAYER + 1, g)[3]
    everything = tensors | other | _unrelated(g)
    root = _write(tmp_path_factory.mktemp("ckpt"), everything)
    return root, routed, shared, bias, tensors, everything


def _by_hand(tensors: dict, prefix: str, rank: int, world: int) -> CheckpointWeights:
    """Rank ``rank``'s slice of one expert straight from the HF tensors."""
    w = I // world
    rows, blocks = slice(rank * w, (rank + 1) * w), slice(rank * w // 128, (rank + 1) * w // 128)
    gate, up = tensors[f"{prefix}.gate_proj.weight"], tensors[f"{prefix}.up_proj.weight"]
    gs = tensors[f"{prefix}.gate_proj.weight_scale_inv"]
    us = tensors[f"{prefix}.up_proj.weight_scale_inv"]
    w13 = torch.cat([_bytes(gate[rows]), _bytes(up[rows])]).view(FP8)
    return CheckpointWeights(
        w13=w13[None],
        w13_scale=torch.cat([gs[blocks], us[blocks]])[None],
        w2=tensors[f"{prefix}.down_proj.weight"][:, rows].contiguous()[None],
        w2_scale=tensors[f"{prefix}.down_proj.weight_scale_inv"][:, blocks].contiguous()[None],
    )


def _stack(parts: list[CheckpointWeights]) -> CheckpointWeights:
    fields = ("w13", "w13_scale", "w2", "w2_scale")
    joined = {}
    for f in fields:
        cat = torch.cat([_bytes(getattr(p, f)) for p in parts])
        joined[f] = cat.view(FP8) if getattr(parts[0], f).dtype == FP8 else cat
    return CheckpointWeights(**joined)


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_slices_match_hand_slicing_and_sharding(model, rank):
    """Rank r of 2: checkpoint layout equals the HF tensors sliced by hand
    and split_checkpoint's shard r; the prepared weights equal prepare() of
    it; the bias is the layer's (not layer 4's)."""
    root, routed, shared, bias, tensors, _ = model
    raw = read_layer(root, LAYER, rank=rank, world=2)
    hand = _stack([_by_hand(tensors, f"model.layers.{LAYER}.mlp.experts.{e}", rank, 2)
                   for e in range(E)])  # fmt: skip
    hand_shared = _by_hand(tensors, f"model.layers.{LAYER}.mlp.shared_experts", rank, 2)
    assert _same_experts(raw.routed, hand) and _same_experts(raw.shared, hand_shared)
    assert _same_experts(raw.routed, split_checkpoint(routed, 2)[rank])
    assert _same_experts(raw.shared, split_checkpoint(shared, 2)[rank])
    assert torch.equal(raw.bias, bias) and raw.bias.dtype == torch.float32

    loaded = load_layer(root, LAYER, rank=rank, world=2, shape=SHAPE2)
    assert (loaded.hidden, loaded.inter, loaded.experts) == (H, I // 2, E)
    assert _same_experts(loaded.weights.routed, prepare(hand))
    assert _same_experts(loaded.weights.shared, prepare(hand_shared))
    assert torch.equal(loaded.bias, bias)
    for part in (loaded.weights.routed, loaded.weights.shared):
        assert isinstance(part, ExpertWeights)
        assert all(t.is_contiguous() for t in part.tensors())


def test_world_one_is_the_whole_layer(model):
    root, routed, shared, bias, _, _ = model
    loaded = load_layer(root, LAYER, shape=replace(SHAPE2, inter=I))
    assert _same_experts(loaded.weights.routed, prepare(routed))
    assert _same_experts(loaded.weights.shared, prepare(shared))
    assert torch.equal(loaded.bias, bias)


def test_single_file_and_paths_of_either_file(model, tmp_path):
    """A directory with one model.safetensors, that file's path, and the
    index file's path all read the same layer."""
    root, routed, shared, _, _, everything = model
    single = _write(tmp_path / "one", everything, shards=1)
    want = prepare(split_checkpoint(routed, 2)[1])
    for path in (single, single / "model.safetensors", root / "model.safetensors.index.json"):
        loaded = load_layer(path, LAYER, rank=1, world=2, names="deepseek_v3")
        assert _same_experts(loaded.weights.routed, want), path
    assert _same_experts(read_layer(single, LAYER).shared, shared)


def test_reads_only_the_layers_tensors(model, monkeypatch):
    """Of the checkpoint, only layer LAYER's expert weights, scales and bias
    are opened for reading (not the router weight, layer 4 or the rest)."""
    root, _, _, _, tensors, _ = model
    real, opened = ck.Checkpoint.meta, []

    def meta(self, name):
        opened.append(name)
        return real(self, name)

    monkeypatch.setattr(ck.Checkpoint, "meta", meta)
    load_layer(root, LAYER, rank=0, world=2)
    wanted = {n for n in tensors if not n.endswith("mlp.gate.weight")}
    assert set(opened) == wanted


def test_other_families_by_a_names_row(tmp_path):
    """A family with other names (Mixtral-style w1/w3/w2 projections, no
    shared expert) is one ``Names`` row away."""
    g = seeding.generator()
    routed = random_checkpoint(E, H, I, g)
    names = Names(expert="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}",
                  shared=None, bias="model.layers.{layer}.block_sparse_moe.router_bias",
                  gate="w1", up="w3", down="w2", scale="weight_scale")  # fmt: skip
    tensors = {}
    for name, t in _hf(routed, lambda e: f"model.layers.0.block_sparse_moe.experts.{e}").items():
        name = name.replace("gate_proj", "w1").replace("up_proj", "w3").replace("down_proj", "w2")
        tensors[name.replace("weight_scale_inv", "weight_scale")] = t
    tensors["model.layers.0.block_sparse_moe.router_bias"] = torch.zeros(E).bfloat16()
    root = _write(tmp_path / "m", tensors)
    loaded = load_layer(root, 0, rank=1, world=2, names=names)
    assert loaded.weights.shared is None
    assert _same_experts(loaded.weights.routed, prepare(split_checkpoint(routed, 2)[1]))
    assert loaded.bias.dtype == torch.float32 and not loaded.bias.any()


def test_refusals_name_what_is_wrong(model, tmp_path):
    root, _, _, _, tensors, everything = model
    with pytest.raises(CheckpointError, match=r"inter 256 does not split into 4 .* 128-column"):
        load_layer(root, LAYER, rank=0, world=4)
    with pytest.raises(CheckpointError, match=r"rank 2 of world 2"):
        load_layer(root, LAYER, rank=2, world=2)
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.mlp\.gate\.e_score_correction_bias.*layer 0 an MoE"
    ):
        load_layer(root, 0)
    with pytest.raises(CheckpointError, match=r"artifact's shape has .*'inter': 256"):
        load_layer(root, LAYER, rank=0, world=2, shape=replace(SHAPE2, inter=I))
    with pytest.raises(CheckpointError, match=r"unknown family 'llama'"):
        load_layer(root, LAYER, names="llama")
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor"):
        load_layer(tmp_path, LAYER)
    with pytest.raises(CheckpointError, match="nope.json: no such file"):
        load_layer(tmp_path / "nope.json", LAYER)
    with pytest.raises(CheckpointError, match="expected a directory, an index .json or"):
        load_layer(tmp_path / "model.bin", LAYER)
    (tmp_path / "bad.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="bad.json: not a safetensors index"):
        load_layer(tmp_path / "bad.json", LAYER)

    missing = f"model.layers.{LAYER}.mlp.experts.4.up_proj.weight_scale_inv"
    broken = _write(tmp_path / "missing", {k: v for k, v in everything.items() if k != missing})
    with pytest.raises(
        CheckpointError, match=rf"'{missing}' is not in model.safetensors.index.json's weight_map"
    ):
        load_layer(broken, LAYER)

    wrong = f"model.layers.{LAYER}.mlp.experts.2.down_proj.weight"
    bad = _write(tmp_path / "dtype", everything | {wrong: everything[wrong].float().bfloat16()})
    file = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][wrong]
    with pytest.raises(
        CheckpointError, match=rf"'{wrong}' in {file}: expected F8_E4M3 \[256, 256\], found BF16"
    ):
        load_layer(bad, LAYER)

    gone = _write(tmp_path / "gone", everything)
    (gone / file).unlink()
    with pytest.raises(CheckpointError, match=rf"shard {file} .* does not exist"):
        load_layer(gone, LAYER)

    no_shared = {k: v for k, v in everything.items() if "shared_experts" not in k}
    root2 = _write(tmp_path / "noshared", no_shared)
    assert read_layer(root2, LAYER).shared is None
    with pytest.raises(CheckpointError, match=r"shared_experts\.gate_proj\.weight' is not in"):
        load_layer(root2, LAYER, rank=0, world=2, shape=SHAPE2)
    routed_only = load_layer(root2, LAYER, world=2, shape=replace(SHAPE2, shared_experts=0))
    assert routed_only.weights.shared is None
    name = DEEPSEEK_V3.routed(7, 5, "up_proj", "weight")
    assert name == "model.layers.7.mlp.experts.5.up_proj.weight"


def test_a_family_without_bias_or_shared_expert(tmp_path):
    """Qwen3-MoE (``QWEN3_MOE``): the same expert names, no shared expert, a
    router without bias: the expert count comes from the router weight and
    the layer's bias is None; a shape that expects a bias refuses it."""
    g = seeding.generator()
    routed = random_checkpoint(E, H, I, g)
    tensors = _hf(routed, lambda e: f"model.layers.{LAYER}.mlp.experts.{e}")
    tensors[f"model.layers.{LAYER}.mlp.gate.weight"] = torch.randn(E, H, generator=g).bfloat16()
    root = _write(tmp_path / "q", tensors)
    plain = replace(SHAPE2, shared_experts=0, bias=False, score="softmax")
    loaded = load_layer(root, LAYER, rank=0, world=2, names="qwen3_moe", shape=plain)
    assert loaded.bias is None and loaded.weights.shared is None and loaded.experts == E
    assert _same_experts(loaded.weights.routed, prepare(split_checkpoint(routed, 2)[0]))
    assert read_layer(root, LAYER, names=ck.QWEN3_MOE).bias is None
    with pytest.raises(CheckpointError, match="has a score-correction bias"):
        load_layer(root, LAYER, rank=0, world=2, names="qwen3_moe",
                   shape=replace(plain, bias=True))  # fmt: skip
    with pytest.raises(CheckpointError, match="mlp.gate.weight"):
        load_layer(root, LAYER + 1, names="qwen3_moe")

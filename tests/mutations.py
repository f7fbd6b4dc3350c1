"""Mistakes in shipped code that the CPU tests must catch, and a runner that
makes each one in a scratch copy of the tree and checks its tests fail.

    python3 tests/mutations.py            # every mistake; exit 1 if one survives
    python3 tests/mutations.py -k cache   # those whose name contains "cache"

Each entry is a single exact text replacement in one shipped file (``old``
must occur there exactly once: tests/test_mutations.py checks it, so the
table cannot drift from the code) and the pytest node ids that must fail
once it is made. The copy is of the files git tracks, in a temporary
directory; the working tree is never touched. tests/MUTATIONS.md is the same
list for reading.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "workspace-shared-across-streams", "runtime/workspace.py",
        "record = (stream, variant.kernel, need.name, need.bytes, need.zero)",
        "record = (variant.kernel, need.name, need.bytes, need.zero)",
        ("tests/test_runtime_devices.py::test_workspaces_are_kept_per_stream",),
    ),
    Mutation(
        "unpack-duplicate-member-allowed", "runtime/artifact.py",
        "if target.exists():\n                    raise",
        "if False:\n                    raise",
        ("tests/test_runtime_artifact.py::test_unpack_refuses_clashing_members",),
    ),
    Mutation(
        "unpack-cap-per-member", "runtime/artifact.py",
        "                written += member.size\n",
        "                written = member.size\n",
        ("tests/test_runtime_artifact.py::test_unpack_refuses_files_past_the_limit_before_reading_them",),
    ),
    Mutation(
        "tokens-and-sms-unchecked", "runtime/artifact.py",
        'if record["tokens"] < 1 or record["sms"] < 1 or not record["entry"]:',
        'if not record["entry"]:',
        ("tests/test_runtime_artifact.py::test_refuses_non_positive_tokens_and_sms",),
    ),
    Mutation(
        "reqntid-unchecked", "pipeline/manifest.py",
        "if kernel.reqntid is not None and tuple(kernel.reqntid) != block:",
        "if False and kernel.reqntid is not None and tuple(kernel.reqntid) != block:",
        ("tests/test_pipeline_manifest.py::test_block_other_than_reqntid_is_refused",),
    ),
    Mutation(
        "cache-key-skips-relative-imports", "kernels/registry.py",
        "base = _absolute(node.module, node.level, package)",
        "base = node.module if node.level == 0 else None",
        ("tests/test_pipeline_cache.py::test_relative_imports_of_an_outside_kernel_are_followed",),
    ),
    Mutation(
        "cache-key-skips-the-package", "kernels/registry.py",
        "seen: set[Path] = set(package_files())",
        "seen: set[Path] = set()",
        ("tests/test_pipeline_cache.py::test_source_hashes_cover_the_package_and_an_outside_module",
         "tests/test_pipeline_cache.py::test_editing_a_ptx_helper_changes_every_kernel_key"),
    ),
    Mutation(
        "call-counter-aliases-parity", "kernels/grouped_plan.py",
        "finished=words - 1, calls=2 * words,",
        "finished=words - 1, calls=2 * words - 1,",
        ("tests/test_grouped_plan.py::test_call_counter_and_parity_words_never_overlap",),
    ),
    Mutation(
        "partial-workspace-halved", "kernels/grouped_plan.py",
        'Workspace("partial", 2 * grid * 2 * GROUP * TILE * 4)',
        'Workspace("partial", grid * 2 * GROUP * TILE * 4)',
        ("tests/test_grouped_plan.py::test_partial_workspace_holds_every_published_partial",),
    ),
    Mutation(
        "atom-inc-limit", "kernels/grouped_common.py",
        "Uint32(2 * self.grid - 1)",
        "Uint32(2 * self.grid)",
        ("tests/test_grouped_sm90_compile.py::test_call_counter_wraps_at_twice_the_grid",),
    ),
    Mutation(
        "finalize-without-bf16-rounding", "runtime/reference.py",
        "    if rounded:\n        rows = rows.to(torch.bfloat16)",
        "    if False:\n        rows = rows.to(torch.bfloat16)",
        ("tests/test_reference.py::test_finalize_order_and_rounding",),
    ),
    Mutation(
        "persistent-launch-not-cooperative", "runtime/launch.py",
        "cooperative=persistent,",
        "cooperative=False,",
        ("tests/test_sm100_launch.py::test_launch_configuration_on_blackwell",),
    ),
    Mutation(
        "captured-launch-holds-nothing", "runtime/moe.py",
        "graphs.hold(stream, self)",
        "None",
        ("tests/test_runtime_devices.py::test_a_captured_graph_keeps_its_layer_alive",),
    ),
    Mutation(
        "mega-cluster-role-off-by-one", "kernels/mega_plan.py",
        'route = group if plan.order == "shared_last" else routes - 1 - group',
        'route = group if plan.order == "shared_last" else routes - group',
        ("tests/test_mega_plan.py::test_every_cluster_is_one_route_or_one_shared_expert",),
    ),
    Mutation(
        "mega-gemm1-box-ignores-k-part", "kernels/mega_plan.py",
        "expert * plan.nk1 + part * plan.blocks1 + n",
        "expert * plan.nk1 + n",
        ("tests/test_mega_plan.py::test_a_cluster_streams_each_weight_box_of_its_expert_once",),
    ),
    Mutation(
        "mega-b-chunk-unswizzled", "kernels/mega_plan.py",
        "(chunk ^ (row % 8)) * 16",
        "chunk * 16",
        ("tests/test_mega_plan.py::test_b_tile_chunks_are_a_128_byte_swizzle",),
    ),
    Mutation(
        "mega-routed-only-variant-served", "runtime/moe.py",
        "            if routed_only:\n",
        "            if False:\n",
        ("tests/test_runtime_layer.py::test_mega_variants_without_shared_are_refused",),
    ),
)  # fmt: skip


def tracked_copy(dest: Path) -> None:
    """The files git tracks (and untracked, not ignored ones) under ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def survives(m: Mutation, tree: Path) -> tuple[bool, str]:
    """Makes ``m`` in ``tree``, runs its tests, undoes it; (survived, summary)."""
    path = tree / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        return True, f"'old' occurs {text.count(m.old)} times in {m.path}"
    path.write_text(text.replace(m.old, m.new))
    try:
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests],
            cwd=tree, capture_output=True, text=True, env=env,
        )  # fmt: skip
    finally:
        path.write_text(text)
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    return done.returncode != 1, last


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Make each listed mistake; its tests must fail.")
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.k in m.name]
    survived = []
    with tempfile.TemporaryDirectory(prefix="moe-mutations-") as tmp:
        tree = Path(tmp)
        tracked_copy(tree)
        for m in chosen:
            bad, last = survives(m, tree)
            print(f"{'SURVIVED' if bad else 'caught  '}  {m.name:38s} {last}", flush=True)
            if bad:
                survived.append(m.name)
    print(f"{len(chosen) - len(survived)} caught, {len(survived)} survived")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())

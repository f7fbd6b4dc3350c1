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
        "return 2 * grid * 2 * max(GROUPS) * TILE * 4",
        "return grid * 2 * max(GROUPS) * TILE * 4",
        ("tests/test_grouped_plan.py::test_partial_workspace_holds_every_published_partial",),
    ),
    Mutation(
        "atom-inc-limit", "kernels/grouped_plan.py",
        "return 2 * grid - 1",
        "return 2 * grid",
        ("tests/test_grouped_plan.py::test_call_parity_under_any_interleaving",
         "tests/test_grouped_sm90_compile.py::test_call_counter_wraps_at_twice_the_grid"),
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
        "call-plan-kept-after-workspaces-remade", "runtime/moe.py",
        "if plan is None or plan.workspace is not workspace:",
        "if plan is None:",
        ("tests/test_host_path.py::test_a_plan_is_remade_with_the_workspaces",),
    ),
    Mutation(
        "call-plan-unlocked", "runtime/moe.py",
        "        with self._lock:\n            if self.valid_slot is not None:",
        "        if True:\n            if self.valid_slot is not None:",
        ("tests/test_host_path.py::test_threads_sharing_a_plan_launch_their_own_addresses",),
    ),
    Mutation(
        "call-plan-valid-not-rewritten", "runtime/moe.py",
        "                values[self.valid_slot] = self.variant.tokens if valid is None else valid",
        "                pass",
        ("tests/test_host_path.py::test_a_grouped_call_below_its_bucket_launches_unpadded",),
    ),
    Mutation(
        "grouped-call-padded-anyway", "runtime/moe.py",
        "        unpadded = m != bucket and variant.name in self.unpadded",
        "        unpadded = False",
        ("tests/test_host_path.py::test_a_grouped_call_below_its_bucket_launches_unpadded",),
    ),
    Mutation(
        "call-plan-inputs-not-rewritten", "runtime/moe.py",
        "                values[i] = addresses[j]",
        "                pass",
        ("tests/test_host_path.py::test_plans_launch_what_a_fill_by_name_gives",),
    ),
    Mutation(
        "capture-query-skipped-on-another-device", "runtime/graphs.py",
        "    if torch.cuda.current_device() != ordinal:\n        return True\n",
        "",
        ("tests/test_host_path.py::test_captured_launches_hold_the_layer",),
    ),
    Mutation(
        "context-never-pushed", "runtime/moe.py",
        "        if driver.context_is_current(self.ordinal):",
        "        if True:",
        ("tests/test_host_path.py::test_the_context_is_pushed_only_when_not_current",),
    ),
    Mutation(
        "check-call-fast-path-skips-bias-alignment", "runtime/inputs.py",
        "(x.data_ptr() | logits.data_ptr() | bias.data_ptr()) % ALIGN",
        "(x.data_ptr() | logits.data_ptr()) % ALIGN",
        ("tests/test_host_path.py::test_checks_after_an_accepted_call_refuse_as_before",),
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
    Mutation(
        "grouped-ranges-split-at-the-limit", "kernels/grouped_plan.py",
        "split = select(units > SPLIT_UNITS, (units + 1) // 2, units)",
        "split = select(units >= SPLIT_UNITS, (units + 1) // 2, units)",
        ("tests/test_grouped_plan.py::test_halves_split_above_split_units",),
    ),
    Mutation(
        "grouped-ranges-half-b-start", "kernels/grouped_plan.py",
        "lo1a, lo1b = cta * s1a // g, cta * s1b // g",
        "lo1a, lo1b = cta * s1a // g, cta * s1a // g",
        ("tests/test_grouped_plan.py::test_fc1_stages_covered_once",),
    ),
    Mutation(
        "grouped-owner-off-by-one", "kernels/grouped_plan.py",
        "return ((s + 1) * plan.grid - 1) // size",
        "return (s * plan.grid) // size",
        ("tests/test_grouped_plan.py::test_owner_agrees_with_ranges",),
    ),
    Mutation(
        "grouped-locate-half-b-unit", "kernels/grouped_plan.py",
        "return s_b, r.split + s_b // plan.unit1",
        "return s_b, s_b // plan.unit1",
        ("tests/test_grouped_plan.py::test_fc1_stages_covered_once",),
    ),
    Mutation(
        "grouped-locate-gate-tile", "kernels/grouped_plan.py",
        "tile = q // plan.span + plan.pairs * (q % 2)",
        "tile = q // plan.span + (q % 2)",
        ("tests/test_grouped_plan.py::test_fc1_stages_covered_once",),
    ),
    Mutation(
        "grouped-describe-half-a-end-open", "kernels/grouped_plan.py",
        "closes = (n == n1a - 1) | (n == n1a + r.n1b - 1)",
        "closes = (n == n1a + r.n1b - 1)",
        ("tests/test_grouped_plan.py::test_fc1_stages_covered_once",),
    ),
    Mutation(
        "grouped-pack-half-bit", "kernels/grouped_plan.py",
        "| word(half) << BIT_HALF |",
        "| word(half) << BIT_FC2 |",
        ("tests/test_grouped_plan.py::test_pack_roundtrip_and_end",),
    ),
    Mutation(
        "grouped-unpack-kb-field", "kernels/grouped_plan.py",
        "field((word >> SHIFT_KB) & ((1 << KB_BITS) - 1)),",
        "field((word >> SHIFT_TILE) & ((1 << KB_BITS) - 1)),",
        ("tests/test_grouped_plan.py::test_pack_roundtrip_and_end",),
    ),
    Mutation(
        "grouped-fc2-word-k-blocks", "kernels/grouped_plan.py",
        "pack(True, 0, unit, tile, plan.depth * k, k == 0",
        "pack(True, 0, unit, tile, k, k == 0",
        ("tests/test_grouped_plan.py::test_fc2_jobs_cover_every_unit_tile",),
    ),
    Mutation(
        "grouped-job-of-ignores-half", "kernels/grouped_plan.py",
        "return first + job // plan.tiles2, job % plan.tiles2",
        "return job // plan.tiles2, job % plan.tiles2",
        ("tests/test_grouped_plan.py::test_fc2_jobs_cover_every_unit_tile",),
    ),
    Mutation(
        "grouped-pair-whole-either-end", "kernels/grouped_plan.py",
        "whole = (start == base) & (s == base + plan.span - 1)",
        "whole = (start == base) | (s == base + plan.span - 1)",
        ("tests/test_grouped_plan.py::test_fc1_stages_covered_once",),
    ),
    Mutation(
        "grouped-pair-owners-last", "kernels/grouped_plan.py",
        "owner(plan, base + plan.span - 1, size)",
        "owner(plan, base + plan.span, size)",
        ("tests/test_grouped_plan.py::test_fc1_stages_covered_once",),
    ),
    Mutation(
        "grouped-weight-box-fc2-chunk", "kernels/grouped_plan.py",
        "chunk = select(fc2, safe * plan.nk2 + kb, safe * plan.nk1 + kb)",
        "chunk = select(fc2, safe * plan.nk1 + kb, safe * plan.nk1 + kb)",
        ("tests/test_grouped_plan.py::test_a_unit_streams_each_weight_box_of_its_expert_once",),
    ),
    Mutation(
        "grouped-weight-box-shared-map", "kernels/grouped_plan.py",
        "index = select(shared, 2, 0)",
        "index = select(shared, 0, 0)",
        ("tests/test_grouped_plan.py::test_a_unit_streams_each_weight_box_of_its_expert_once",),
    ),
    Mutation(
        "grouped-scale-index-fc1-rows", "kernels/grouped_plan.py",
        "return (expert * (2 * plan.pairs) + tile) * plan.nk1 + kb",
        "return (expert * plan.pairs + tile) * plan.nk1 + kb",
        ("tests/test_grouped_plan.py::test_scale_index_is_the_row_major_index_of_the_abi_shapes",),
    ),
    Mutation(
        "grouped-mask-slot-word", "kernels/grouped_plan.py",
        "return words * expert + token // 32, token % 32",
        "return expert + token // 32, token % 32",
        ("tests/test_grouped_plan.py::test_number_units",),
    ),
    Mutation(
        "grouped-rank-skips-the-lower-words", "kernels/grouped_plan.py",
        "rank = rank + select(bit >= 32, popc(m), select(bit >= 0, below, 0))",
        "rank = rank + select(bit >= 32, 0, select(bit >= 0, below, 0))",
        ("tests/test_grouped_plan.py::test_number_units",),
    ),
    Mutation(
        "grouped-units-of-floor", "kernels/grouped_plan.py",
        "return (routes + group - 1) // group",
        "return routes // group",
        ("tests/test_grouped_plan.py::test_number_units",),
    ),
    Mutation(
        "grouped-unit-size-short", "kernels/grouped_plan.py",
        "return minimum(count - first, group)",
        "return minimum(count - first, group - 1)",
        ("tests/test_grouped_plan.py::test_number_units",),
    ),
    Mutation(
        "grouped-ring-index-wraps-at-stages", "kernels/grouped_plan.py",
        "return (n % layout.ring) * (layout.depth * layout.group)",
        "return (n % layout.stages) * (layout.depth * layout.group)",
        ("tests/test_grouped_plan.py::test_scale_ring_entries_live_a_whole_ring",),
    ),
    Mutation(
        "grouped-b-chunk-unswizzled", "kernels/grouped_plan.py",
        "(chunk ^ (row % 8)) * 16",
        "chunk * 16",
        ("tests/test_grouped_plan.py::test_b_tile_chunks_are_a_128_byte_swizzle",),
    ),
    Mutation(
        "grouped-partial-slot-ignores-half", "kernels/grouped_plan.py",
        "return half * plan.grid + cta",
        "return cta",
        ("tests/test_grouped_plan.py::test_partial_workspace_holds_every_published_partial",),
    ),
    Mutation(
        "grouped-pair-counter-at-ready-word", "kernels/grouped_plan.py",
        "return plan.counters.pairs + unit * plan.pairs + pair",
        "return unit * plan.pairs + pair",
        ("tests/test_grouped_plan.py::test_call_counter_and_parity_words_never_overlap",),
    ),
    Mutation(
        "grouped-zero-share-floor", "kernels/grouped_plan.py",
        "return ceil_div(words, grid)",
        "return words // grid",
        ("tests/test_grouped_plan.py::test_call_counter_and_parity_words_never_overlap",),
    ),
    Mutation(
        "grouped-call-parity", "kernels/grouped_plan.py",
        "    return calls // grid\n",
        "    return calls % 2\n",
        ("tests/test_grouped_plan.py::test_call_parity_under_any_interleaving",),
    ),
    Mutation(
        "grouped-layout-barriers-short", "kernels/grouped_plan.py",
        'r.take("bar", bars * 8, 8)',
        'r.take("bar", bars * 4, 8)',
        ("tests/test_grouped_plan.py::test_fit_layout_keeps_the_device_contract",),
    ),
    Mutation(
        "grouped-device-copy-of-owner", "kernels/grouped_common.py",
        "first, last = gp.pair_owners(self.plan, base, size)",
        "first, last = base * self.grid // size, (base + self.span) * self.grid // size",
        ("tests/test_grouped_plan.py::test_the_device_code_calls_the_plan_formulas",),
    ),
    Mutation(
        "grouped-pair-waits-for-every-cta", "kernels/grouped_plan.py",
        "return select(size >= plan.grid, last - first, plan.span - 1)",
        "return last - first",
        ("tests/test_grouped_plan.py::test_fc1_cover_halves_of_fewer_stages_than_ctas",
         "tests/test_grouped_plan.py::test_holds_stages_is_a_nonempty_range"),
    ),
    Mutation(
        "grouped-owner-sums-empty-ctas", "kernels/grouped_common.py",
        "if gp.holds_stages(self.plan, c, size):",
        "if True:",
        ("tests/test_grouped_plan.py::test_the_device_code_calls_the_plan_formulas",),
    ),
    Mutation(
        "grouped-depth-two-for-odd-inter", "kernels/grouped_plan.py",
        "return DEPTH if (hidden // TILE) % DEPTH == 0 and (inter // TILE) % DEPTH == 0 else 1",
        "return DEPTH if (hidden // TILE) % DEPTH == 0 else 1",
        ("tests/test_grouped_plan.py::test_stage_depth_divides_both_k_extents",),
    ),
    Mutation(
        "mega-gemm2-tile-unclamped", "kernels/mega_plan.py",
        "    return minimum(tile, plan.tiles_out - 1)\n",
        "    return tile\n",
        ("tests/test_mega_plan.py::test_a_cluster_streams_each_weight_box_of_its_expert_once",),
    ),
    Mutation(
        "mega-stores-a-tile-past-the-output", "kernels/mega_plan.py",
        "    return rank * plan.tiles2 + t < plan.tiles_out\n",
        "    return rank * plan.tiles2 + t <= plan.tiles_out\n",
        ("tests/test_mega_plan.py::test_a_cluster_streams_each_weight_box_of_its_expert_once",),
    ),
    Mutation(
        "mega-finalize-slice-past-h", "kernels/mega_plan.py",
        "    return minimum(plan.rows2, plan.hidden - rank * plan.rows2)\n",
        "    return plan.rows2\n",
        ("tests/test_mega_plan.py::test_every_slice_of_final_has_one_last_arriver",),
    ),
    Mutation(
        "mega-split-ignores-k-blocks", "kernels/mega_plan.py",
        "and nk1 % (split * 2) == 0 and nk1 // (split * 2) >= cfg.min_blocks):",
        "and nk1 >= 0 and nk1 // (split * 2) >= cfg.min_blocks):",
        ("tests/test_mega_plan.py::test_a_cluster_streams_each_weight_box_of_its_expert_once",),
    ),
    Mutation(
        "mega-split-ignores-the-grid", "kernels/mega_plan.py",
        "        if cfg.split_one_wave and not one_wave(arch, groups, tiles1 * split * 2, sms):\n",
        "        if cfg.split_one_wave and sms <= 0:\n",
        ("tests/test_mega_plan.py::test_sm90_splits_k_while_the_split_grid_is_one_wave",),
    ),
    Mutation(
        "mega-tmem-accumulators-round-down", "kernels/mega_plan.py",
        "        return -(-self.blocks1 // self.config.b_rows)\n",
        "        return self.blocks1 // self.config.b_rows\n",
        ("tests/test_mega_sm100.py::test_tmem_columns_cover_every_accumulator",),
    ),
    Mutation(
        "routing-group-ties-to-the-higher-group", "kernels/routing.py",
        "ahead = ahead + ops.select(totals[h] >= totals[g], one, zero)",
        "ahead = ahead + ops.select(totals[h] > totals[g], one, zero)",
        ("tests/test_routing_groups.py::test_hand_computed_groups_and_ties",),
    ),
    Mutation(
        "routing-group-runner-up-lane-local", "kernels/routing.py",
        "runner = ops.redux_max(ops.select(lane_u == holder, second, first))",
        "runner = ops.redux_max(ops.select(lane_u == holder, second, second))",
        ("tests/test_routing_groups.py::test_random_tokens_match_the_reference",),
    ),
    Mutation(
        "local-routing-on-a-grid-below-m", "kernels/grouped_plan.py",
        "self.tokens <= min(LOCAL_ROUTING_TOKENS, self.grid)",
        "self.tokens <= LOCAL_ROUTING_TOKENS",
        ("tests/test_grouped_plan.py::test_local_routing_up_to_one_token_a_warp",),
    ),
    Mutation(
        "bench-pinned-figure-without-a-cpu", "benchmarks/bench.py",
        "pinned = None if self.host_cpu is None else time_host(calls, cpu=self.host_cpu)",
        "pinned = time_host(calls, cpu=self.host_cpu)",
        ("tests/test_bench.py::test_run_counts_the_shared_expert_only_where_the_model_has_one",),
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

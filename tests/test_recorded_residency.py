"""The cluster residency recorded for a target (``runtime.constants.
RESIDENT_CLUSTERS``, which the mega plan's occupancy reads) is what the
committed H200 benchmarks measured: each result JSON's ``residency`` holds,
per variant, its grid, the CTAs the device held at once (the driver's
cluster occupancy x cluster size) and its CTAs per SM. The cluster size is
taken from the grid and the model's clusters (M x (top_k + shared)), not
from the plan under test."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.constants import RESIDENT_CLUSTERS

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def measured():
    """((arch, sms), cluster, ctas_per_sm) -> resident clusters, from every
    committed result with a ``residency`` record (mega variants)."""
    found = {}
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        # Only bench results carry ``residency``; other committed records
        # (timelines, A/Bs) name their artifact by path, not by manifest.
        if not result.get("residency"):
            continue
        model = result["artifact"]["model"]
        for name, r in result["residency"].items():
            match = re.fullmatch(r"mega-(sm_\w+)-m(\d+)-\w+", name)
            if not match:
                continue
            arch, tokens = match.group(1), int(match.group(2))
            groups = tokens * (model["top_k"] + model["shared_experts"])
            assert r["grid"] % groups == 0, (path.name, name)
            cluster = r["grid"] // groups
            assert r["resident"] % cluster == 0, (path.name, name)
            key = ((arch, result["sms"]), cluster, r["ctas_per_sm"])
            count = r["resident"] // cluster
            assert found.setdefault(key, count) == count, (path.name, name, key)
    return found


def test_recorded_residency_is_the_measured_one():
    found = measured()
    assert found, "no committed result records residency"
    for (target, cluster, ctas), count in found.items():
        recorded = RESIDENT_CLUSTERS[target][cluster]
        assert len(recorded) >= ctas, (target, cluster, ctas, count)
        assert recorded[ctas - 1] == count, (target, cluster, ctas, count, recorded)


def test_recorded_counts_are_below_the_sm_bound_and_grow_with_occupancy():
    for (_, sms), table in RESIDENT_CLUSTERS.items():
        for cluster, counts in table.items():
            for ctas, count in enumerate(counts, start=1):
                assert 0 < count <= ctas * (sms // cluster), (cluster, ctas)
            assert list(counts) == sorted(counts)

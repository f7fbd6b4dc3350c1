"""The README's performance table is the committed benchmark result it names,
to the digit (the numbers users read are the ones the run measured)."""

import json
import re
from pathlib import Path

from benchmarks.command import summary

ROOT = Path(__file__).resolve().parents[1]


def test_readme_table_matches_the_named_result():
    readme = (ROOT / "README.md").read_text()
    named = re.findall(r"benchmarks/results/([\w.-]+\.json)", readme)
    assert named, "the README names no benchmark result"
    for name in set(named):
        result = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        assert summary(result) in readme, f"README table differs from {name}"
        for key in ("device", "driver", "sms", "copy_tb_s", "commit", "date", "toolchain",
                    "artifact", "rows"):  # fmt: skip
            assert key in result, f"{name} lacks {key}"
        assert all(row["correct"] for row in result["rows"]), name
        assert not result.get("partial"), f"{name} is a run cut short"

"""Same-seed A/B of the layer call across artifacts of one model (needs a GPU):

    python3 -m benchmarks.ab_layer ART_A ART_B [...] --rounds 3 \\
        --tokens 1,2,3,4,8,16,32,64 --routing random,uniform,skewed --json F

Each round runs every artifact, round r starting at the r-th artifact given
(``round_order``: each artifact takes each place in turn, so a drift of the
machine over a run does not always favour the same one); for each artifact
it makes a fresh ``bench.Bench`` with the same seed and times the same cases
in the same order (``Bench.time_case("layer", ...)``: CUDA graphs of ``bench.POOL``
calls, weights rotated over ``bench.COPIES`` copies, ``bench.WARMUP_S`` of
untimed replays, median of ``--reps``), so every artifact meets the same
weights and inputs. The first round first checks the layer of each artifact
against the float64 reference at M = 1, 4, 8 and 64 (random routing), which
draws from the seed too: rows compare across artifacts within a round, and
rounds 1.. with each other. Prints, per case, each artifact's median of each
round in us; an artifact whose check fails is reported and the run exits 1.
Only the layer is timed: for a kernel's own row use ``moe-build bench``.

Before any GPU work the arguments are checked (``parse``): at least one
round and one rep, positive token counts, routing kinds the bench knows,
and artifacts that exist and build one model shape (``config.model`` of
each manifest), since a same-seed comparison of different shapes compares
different work. Bad arguments exit 2 with the reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SEED = 41
CHECK_TOKENS = (1, 4, 8, 64)


def table(times: dict[str, dict[str, list[float]]], artifacts: list[str]) -> list[str]:
    """Markdown rows: one per case, each artifact's medians (us) by round."""
    lines = ["| case | " + " | ".join(artifacts) + " |", "|---" * (len(artifacts) + 1) + "|"]
    for case, per in times.items():
        cells = [" / ".join(f"{t:.1f}" for t in per.get(a, [])) for a in artifacts]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return lines


def round_order(artifacts: list[str], r: int) -> list[str]:
    """The artifacts in round ``r``'s order: the list given, rotated to start
    at its ``r % len``-th entry."""
    k = r % len(artifacts)
    return artifacts[k:] + artifacts[:k]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def _tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers") from None
    if any(t < 1 for t in tokens):
        raise argparse.ArgumentTypeError(f"{text!r}: token counts must be at least 1")
    return tokens


def _routings(text: str) -> list[str]:
    from benchmarks.bench import ROUTINGS

    kinds = text.split(",")
    unknown = [k for k in kinds if k not in ROUTINGS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown routing {', '.join(unknown)} (known: {', '.join(ROUTINGS)})"
        )
    return kinds


def model_shapes(artifacts: list[str]) -> dict[str, dict]:
    """{artifact: its manifest's ``config.model``}; raises ``ValueError``
    naming the artifacts whose shapes differ from the first's, or one that
    cannot be read."""
    from runtime.artifact import ArtifactError, read

    shapes = {}
    for a in artifacts:
        try:
            shapes[a] = read(a).config["model"]
        except (ArtifactError, KeyError, TypeError) as e:
            raise ValueError(f"{a}: not a readable artifact ({e})") from e
    first = artifacts[0]
    other = [a for a in artifacts[1:] if shapes[a] != shapes[first]]
    if other:
        raise ValueError(
            f"{', '.join(other)}: another model shape than {first} "
            f"({shapes[other[0]]} against {shapes[first]})"
        )
    return shapes


def parse(argv=None) -> argparse.Namespace:
    """The checked arguments (exits 2 with the reason on bad ones)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--rounds", type=_positive, default=3)
    ap.add_argument("--tokens", type=_tokens, default="1,2,3,4,8,16,32,64")
    ap.add_argument("--routing", type=_routings, default="random,uniform,skewed")
    ap.add_argument("--reps", type=_positive, default=15)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--json", help="write {case: {artifact: [us by round]}} here")
    args = ap.parse_args(argv)
    if len(set(args.artifacts)) != len(args.artifacts):
        ap.error("an artifact is named twice")
    try:
        model_shapes(args.artifacts)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    from benchmarks.bench import TOLERANCE, Bench

    tokens, routings = args.tokens, args.routing
    times: dict[str, dict[str, list[float]]] = {}
    failed = False
    for r in range(args.rounds):
        for a in round_order(args.artifacts, r):
            b = Bench(a, reps=args.reps, seed=args.seed, log=lambda *_: None)
            if r == 0:
                for m in CHECK_TOKENS:
                    c = b.check("layer", m, "random")
                    ok = c.rel_l2 <= TOLERANCE["layer"]
                    failed |= not ok
                    print(f"check {a} M={m} rel_l2 {c.rel_l2:.2e}{'' if ok else ' WRONG'}")
            for routing in routings:
                for m in tokens:
                    _, per_call, _ = b.time_case("layer", m, routing)
                    key = f"{routing} {m}"
                    times.setdefault(key, {}).setdefault(a, []).append(statistics.median(per_call))
            print(f"round {r} {a}: copy {b.copy_tb_s:.3f} TB/s", flush=True)
            del b
    print("\n".join(table(times, args.artifacts)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(times, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The `moe-build bench` command (registered in ``pipeline.cli``): its options
and exit status, and the two text tables of a result JSON: ``table`` (every
row) and ``summary`` (one line per routing and M: the README's Performance
table). The measuring is ``benchmarks.bench``'s."""

from __future__ import annotations

import sys

import click

DEFAULT_TOKENS = "1,2,3,4,8,16,32,48,64,128,256,384,512,1024"
#: Above the largest bucket the layer runs bucket-sized chunks (runtime.chunks).
MAX_BENCH_TOKENS = 8192


def _tokens(_ctx, _param, value: str) -> list[int]:
    try:
        tokens = sorted({int(t) for t in value.split(",") if t.strip()})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not tokens or tokens[0] < 1 or tokens[-1] > MAX_BENCH_TOKENS:
        raise click.BadParameter(f"token counts must be in 1..{MAX_BENCH_TOKENS}, got {value!r}")
    return tokens


@click.command("bench")
@click.argument("artifact", type=click.Path(exists=True))
@click.option("--tokens", default=DEFAULT_TOKENS, show_default=True, callback=_tokens,
              help="Comma-separated token counts M to time.")  # fmt: skip
@click.option("--routing", "routings", multiple=True, default=("random",), show_default=True,
              type=click.Choice(["random", "uniform", "skewed"]),
              help="Router skew: bias random N(0,0.1), uniform 0, skewed N(0,1); a model "
                   "without a bias gets a per-expert logit offset instead "
                   "(benchmarks.bench.routing_rule) (repeatable).")  # fmt: skip
@click.option("--reps", default=50, show_default=True, help="Graph replays per case.")
@click.option("--seed", type=int, default=None, help="Seed of weights and inputs (default: fresh).")
@click.option(
    "--json", "json_out", type=click.Path(dir_okay=False), help="Write the result JSON here."
)
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), help="Write a PNG plot here.")
def bench(artifact, tokens, routings, reps, seed, json_out, plot_out) -> None:
    """Time ARTIFACT's kernels and full layer on this GPU.

    For each routing and token count M: the layer entry, each kernel variant
    of bucket M, and a plain-torch baseline, on inputs of ARTIFACT's model
    (its routing family, bias or not, shared expert or not; the routing
    rule is in the result JSON's method.routing), each checked against the float64
    reference on fresh inputs (the error pooled over several calls), then timed
    by CUDA graph replay with weights rotated over several copies so L2 cannot
    hold them. Reports time, eager host time per call (free, and with the
    thread pinned to one CPU, beside a fixed CPU workload's time that tells
    a slow machine from a slow call), weight bytes, TB/s and the fraction of
    the device-to-device copy bandwidth measured in the same run; the result
    JSON also records the GPU's clocks, power and throttle reasons at the
    start and end. Exit status 1 if any case disagrees with the reference.
    With --json the file is rewritten after each routing and M with the rows
    so far and "partial": true, and holds the whole result (no "partial")
    once the run ends.
    """
    import torch

    if not torch.cuda.is_available():
        click.echo("error: bench needs a CUDA GPU; none is visible", err=True)
        sys.exit(2)
    from benchmarks import bench as b

    run = b.Bench(artifact, reps=reps, seed=seed, log=lambda s: click.echo(s, err=True))
    # The JSON holds the rows so far after each (routing, M), marked partial,
    # so a run cut short (a time limit, an interrupt) keeps what it measured.
    keep = (
        (lambda rows: b.write_json(run.result(rows, partial=True), json_out)) if json_out else None
    )
    rows = run.run(tokens, routings, done=keep)
    result = run.result(rows)
    if json_out:
        b.write_json(result, json_out)
        click.echo(f"wrote {json_out}", err=True)
    if plot_out:
        b.plot(result, plot_out)
        click.echo(f"wrote {plot_out}", err=True)
    click.echo(table(result))
    click.echo("")
    click.echo(summary(result))
    wrong = [r for r in rows if not r.correct]
    if wrong:
        for r in wrong:
            click.echo(f"error: {r.kernel} M={r.tokens} {r.routing}: rel_l2 {r.rel_l2:.3e} "
                       f"above tolerance", err=True)  # fmt: skip
        sys.exit(1)


def table(result: dict) -> str:
    """A Markdown table of every row of a result: times in us, ``host (us)``
    the eager host time per call (blank where the row has none, as the
    baseline's and every row of results that predate it)."""
    lines = [
        f"{result['device']} (driver {result['driver']}, {result['sms']} SMs), copy bandwidth "
        f"{result['copy_tb_s']:.2f} TB/s, commit {result['commit'][:10]}, {result['date']}",
        "",
        "| routing | M | kernel | distinct experts | MB read | time (us) | host (us) | TB/s | "
        "% of copy | vs torch | rel L2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        kernel = r["kernel"] + (" (final)" if r.get("finalize") else "")
        if r.get("bucket") not in (None, r["tokens"]):
            kernel += f" (padded to {r['bucket']})"
        speed = f"{r['speedup_vs_baseline']:.1f}x" if r.get("speedup_vs_baseline") else ""
        host = "" if r.get("host_us") is None else f"{r['host_us']:.1f}"
        lines.append(
            f"| {r['routing']} | {r['tokens']} | {kernel} | {r['distinct_experts']} | "
            f"{r['weight_bytes'] / 1e6:.1f} | {r['time_us']:.1f} | {host} | {r['tb_s']:.2f} | "
            f"{100 * r['floor_fraction']:.0f}% | {speed} | {r['rel_l2']:.1e} |"
        )
    return "\n".join(lines)


def summary(result: dict) -> str:
    """One line per (routing, M): the layer entry, the fastest kernel variant
    that serves M directly, and the torch baseline (the README's table).

    A ``layer host (us)`` column (the layer's eager host time per call) is
    there only when every layer row has ``host_us``, and ``pinned (us)`` (the
    same with the thread pinned to one CPU) only when every layer row has
    ``host_pinned_us``, so a result that predates a field gives the table it
    gave before."""
    rows = result["rows"]
    layers = [r for r in rows if r["kernel"] == "layer"]
    with_host = all(r.get("host_us") is not None for r in layers)
    with_pinned = with_host and all(r.get("host_pinned_us") is not None for r in layers)
    lines = [
        f"{result['device']}, copy bandwidth {result['copy_tb_s']:.2f} TB/s "
        f"(commit {result['commit'][:9]}, {result['date'][:10]})",
        "",
        "| routing | M | layer (us) | layer % of copy | "
        + ("layer host (us) | " if with_host else "")
        + ("pinned (us) | " if with_pinned else "")
        + "fastest kernel | kernel (us) | kernel % of copy | torch (us) | layer vs torch |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * (with_host + with_pinned),
    ]
    keys = sorted({(r["routing"], r["tokens"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for routing, m in keys:
        here = [r for r in rows if r["routing"] == routing and r["tokens"] == m]
        layer = next(r for r in here if r["kernel"] == "layer")
        base = next(r for r in here if r["kernel"] == "baseline")
        direct = [r for r in here if r["kernel"] in ("mega", "grouped")
                  and r.get("bucket") in (None, m)]  # fmt: skip
        host = f"| {layer['host_us']:.1f} " if with_host else ""
        host += f"| {layer['host_pinned_us']:.1f} " if with_pinned else ""
        if direct:
            best = min(direct, key=lambda r: r["time_us"])
            name = best["kernel"] + (" (final)" if best.get("finalize") else "")
            kernel = f"{name} | {best['time_us']:.1f} | {100 * best['floor_fraction']:.0f}%"
        else:  # above the largest bucket: the layer runs chunks, no one kernel serves M
            kernel = "chunks | - | -"
        lines.append(
            f"| {routing} | {m} | {layer['time_us']:.1f} | {100 * layer['floor_fraction']:.0f}% "
            f"{host}| {kernel} | {base['time_us']:.0f} | {layer['speedup_vs_baseline']:.0f}x |"
        )
    return "\n".join(lines)

"""`moe-build`: compile MoE decode kernels ahead of time and manage their
artifacts. Each command is a thin layer over a module of this package (``bench``:
of the ``benchmarks`` package, which consumes a build)."""

from __future__ import annotations

import json
import sys

import click
import yaml

from benchmarks.command import bench
from pipeline import commands
from pipeline.config import ConfigError, load_config
from pipeline.variants import expand

#: Exit status for a config or input the tool refuses (click uses 2 for usage errors too).
EXIT_BAD_INPUT = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moe-build")
def main() -> None:
    """Ahead-of-time builds of fused FP8 MoE decode kernels.

    \b
    Typical flow:
      moe-build validate configs/glm5.yaml      check a config, list its variants
      moe-build compile configs/glm5.yaml -o artifacts/glm5
      moe-build package artifacts/glm5 -o glm5.tar.zst
      moe-build inspect artifacts/glm5          what was built
      moe-build diff OLD NEW                    what changed between two builds
    """


def load_or_exit(path: str):
    """The validated config, or every problem on stderr and exit status 2."""
    try:
        return load_config(path)
    except ConfigError as e:
        for key, rule in e.problems:
            click.echo(f"error: {e.path}: {key}: {rule}", err=True)
        sys.exit(EXIT_BAD_INPUT)


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def validate(config: str, as_json: bool) -> None:
    """Check CONFIG and print the resolved config and the variants it implies.

    Exit status 0 when the config is valid, 2 (with every problem, naming the
    file, the key and the rule) when it is not. Nothing is written.
    """
    cfg = load_or_exit(config)
    variants = expand(cfg)
    if as_json:
        names = [v.name for v in variants]
        click.echo(json.dumps({"config": cfg.to_dict(), "variants": names}, indent=1))
        return
    click.echo(f"# {config}: valid")
    click.echo(yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None).rstrip())
    click.echo(f"# {len(variants)} variants")
    for v in variants:
        click.echo(f"  {v.name}  (sms {v.sms})")


@main.command("compile")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Artifact directory to write (default: artifacts/<config name>).",
)
@click.option("--arch", "archs", multiple=True, help="Only this arch (repeatable).")
@click.option("--kernel", "kernels", multiple=True, help="Only this kernel (repeatable).")
@click.option(
    "--variant",
    "patterns",
    multiple=True,
    help="Only variants whose name matches this pattern, e.g. '*-m1-float32' (repeatable).",
)
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Compiler processes (default: the CPUs this process may use).",
)
@click.option("--shard", default=None, help="Build only shard i/n (1-based) of the variants.")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Build cache (default: $MOE_BUILD_CACHE or ~/.cache/moe-build).",
)
@click.option("--no-cache", is_flag=True, help="Compile everything; read and write no cache.")
@click.option("--json", "as_json", is_flag=True, help="Progress as JSON lines on stdout.")
def compile_cmd(config, out, archs, kernels, patterns, jobs, shard, cache_dir, no_cache, as_json):
    """Compile CONFIG's variants into an artifact directory.

    Writes OUT/manifest.json and one zstandard cubin per variant, atomically:
    a failed or interrupted build leaves no artifact (and an existing one
    untouched). Exit status 0 on success, 1 when a variant fails to compile
    (each failure names its variant), 2 for bad input (config, --arch,
    --kernel, --shard, output path).
    """
    cfg = load_or_exit(config)
    sys.exit(
        commands.compile_config(
            cfg, out, archs, kernels, patterns, jobs, shard, cache_dir, no_cache, as_json
        )
    )


@main.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path())
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="Merged artifact directory to write.",
)
def merge(inputs, out):
    """Join shard artifacts (compile --shard i/n) into one artifact.

    The result is byte-identical to building the same selection, with the
    same cubins, on one machine. Refuses inputs of different configs or toolchains, and a set of
    shards with one missing or repeated.
    """
    sys.exit(commands.merge(inputs, out))


@main.command()
@click.argument("artifact", type=click.Path())
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Package file to write (.tar.zst).",
)
def package(artifact, out):
    """Pack a verified ARTIFACT directory into one deterministic .tar.zst."""
    sys.exit(commands.package(artifact, out))


@main.command("inspect")
@click.argument("artifact", type=click.Path())
@click.option("--sass", "variant", default=None, help="Print this variant's SASS instead.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect_cmd(artifact, variant, as_json):
    """Show what ARTIFACT (directory or package) holds, one row per variant."""
    sys.exit(commands.inspect(artifact, variant, as_json))


@main.command()
@click.argument("artifact", type=click.Path())
@click.option(
    "--device",
    "device",
    is_flag=True,
    help="Also load and run every variant of this GPU's arch (needs a GPU).",
)
@click.option("--ordinal", default=0, show_default=True, help="CUDA device ordinal.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify(artifact, device, ordinal, as_json):
    """Check ARTIFACT's hashes, schema and manifest against its cubins.

    With --device: also load each cubin of the GPU's arch, record what the
    driver reports, run each variant once against the reference, and write
    verify-<device>.json beside the manifest. Exit 0 when everything holds, 1
    when something does not, 2 when the artifact cannot be read.
    """
    sys.exit(commands.verify(artifact, device, ordinal, as_json))


@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the changes as JSON.")
def diff(a, b, as_json):
    """What changed from artifact A to artifact B, per variant.

    Exit 1 when anything ABI- or launch-relevant changed (or a verification
    that passed in A fails in B), 0 otherwise, 2 when an artifact is unreadable.
    """
    sys.exit(commands.diff(a, b, as_json))


main.add_command(bench)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# GPU acceptance of one sm_90a artifact, in one go (a GPU machine with the
# serving packages; the artifact compiled elsewhere):
#
#   tests/gpu/acceptance.sh ARTIFACT OUTDIR [--no-bench]
#
# 1. moe-build bench over random, skewed and uniform routing -> OUTDIR/bench.json,
#    .png (every case checked against the float64 reference before it is timed;
#    first, so that a run cut short keeps the headline: the JSON is rewritten
#    after each case);
# 2. the eager host-time profile (benchmarks/host_profile.py);
# 3. compute-sanitizer memcheck and racecheck of one bucket of each kernel, and
#    memcheck of a grouped call below its bucket (13 rows of m16, unpadded) and
#    of the largest grouped bucket;
# 4. the GPU tests (kernels against the float64 reference, layer, graphs,
#    streams, reliability, serving) with $MOE_BUILD_ARTIFACT=ARTIFACT.
# Logs go to OUTDIR; the exit status is the first failing step's. Every model's
# artifact (correctness per routing family, a short bench): tests/gpu/models.sh.
set -uo pipefail
art=${1:?artifact}; out=${2:?output directory}; bench=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MOE_BUILD_ARTIFACT="$art" MOE_MEGA_ARTIFACTS="$art" MOE_GROUPED_ARTIFACTS="$art"
source "$(cd "$(dirname "$0")" && pwd)/steps.sh"
if [ "$bench" != "--no-bench" ]; then
    step bench python3 -m pipeline.cli bench "$art" --routing random --routing skewed \
        --routing uniform --reps 30 --json "$out/bench.json" --plot "$out/bench.png"
fi
step host-profile python3 -m benchmarks.host_profile "$art" --tokens 1,8,13,64,300 --calls 300
for tool in memcheck racecheck; do
    for v in mega-sm_90a-m1-float32 grouped-sm_90a-m8-float32-final; do
        step "$tool-$v" compute-sanitizer --tool "$tool" --error-exitcode 3 --kernel-name kns=moe_ \
            python3 tests/gpu/one_call.py "$art" "$v"
    done
done
# A grouped call below its bucket reads the caller's rows unpadded (``valid``):
# with each tensor an allocation of its own, memcheck sees any read past them.
PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck-grouped-m16-rows13 compute-sanitizer --tool memcheck \
    --error-exitcode 3 --kernel-name kns=moe_ python3 tests/gpu/one_call.py "$art" \
    grouped-sm_90a-m16-float32-final rows=13
# The largest grouped bucket (every table at its largest, CTAs taking several tokens).
largest=$(python3 -c 'import sys
from runtime.artifact import read
print(max(v.tokens for v in read(sys.argv[1]).variants
          if v.kernel == "grouped" and v.arch == "sm_90a" and v.finalize))' "$art")
step "memcheck-grouped-m$largest-final" compute-sanitizer --tool memcheck --error-exitcode 3 \
    --kernel-name kns=moe_ python3 tests/gpu/one_call.py "$art" "grouped-sm_90a-m$largest-bfloat16-final"
step gpu-tests python3 -m pytest -q -s -rs -m gpu tests
exit $status

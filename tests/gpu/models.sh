#!/usr/bin/env bash
# Every model's artifact on this GPU: correctness against the float64 reference of
# its routing family, then a short benchmark. Compiles nothing: the artifacts are
# built on any machine (no GPU needed), one per config, and carried here, e.g.
#
#   make build-all        # artifacts/<config file name> for every config that validates
#   # or, per config:  moe-build compile configs/NAME.yaml -o ART_PARENT/NAME --arch sm_90a
#
# Then, on the GPU machine (the project installed; PYTHON names its interpreter):
#
#   bash tests/gpu/models.sh ART_PARENT OUTDIR
#
# ART_PARENT: a directory holding one artifact per config (directories with a
# manifest.json, or NAME.tar.zst packages; other entries are ignored).
# 1. tests: tests/gpu/test_models_gpu.py over every artifact ($MOE_MODEL_ARTIFACTS):
#    the layer and both kernel entries at M from 1 to 512 (its TOKENS), both logits dtypes, random and
#    skewed routing, one line per case -> OUTDIR/models-tests.log;
# 2. bench: per artifact NAME, `moe-build bench` with random routing at every token
#    bucket the artifact compiled (checked against the reference, then timed)
#    -> OUTDIR/bench-NAME.json (the result JSON) and OUTDIR/bench-NAME.log (its tables).
# 3. sanitize (only when STEPS names it): compute-sanitizer memcheck and racecheck
#    of the mega M = 1 and grouped M = 8 finalize variants of every artifact
#    (tests/gpu/one_call.py) -> OUTDIR/memcheck-NAME-VARIANT.log, ...
# Environment: MODELS="glm5 qwen3-30b-a3b-tp1" takes only those artifacts of
# ART_PARENT, by entry name less .tar.zst (make build-all names them by config file)
# (default: all); STEPS: any of "tests bench sanitize" (default: "tests bench");
# REPS: graph replays per bench case (default 20); PYTHON (default python3).
# Where one command may run only so long, split the run by STEPS and MODELS, e.g.
#
#   STEPS=tests bash tests/gpu/models.sh artifacts out
#   STEPS=bench MODELS="glm5 glm5-tp8 kimi-k2-tp8" bash tests/gpu/models.sh artifacts out
#
# The exit status is the first failing step's (2: bad arguments).
set -uo pipefail
parent=${1:?usage: models.sh ART_PARENT OUTDIR}; out=${2:?usage: models.sh ART_PARENT OUTDIR}
py=${PYTHON:-python3}
steps=${STEPS:-tests bench}
reps=${REPS:-20}
parent=$(cd "$parent" && pwd) || exit 2
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "$0")/../.." || exit 2
export PYTHONUNBUFFERED=1

# The artifacts of ART_PARENT (tests/gpu_artifacts.py decides what is one), by MODELS.
# shellcheck disable=SC2086  # MODELS is a list of names
listing=$(MOE_MODEL_ARTIFACTS="$parent" "$py" - ${MODELS:-} <<'EOF'
import os
import sys

sys.path.insert(0, "tests")
from gpu_artifacts import artifact_name, model_artifacts

found = {artifact_name(p): p for p in model_artifacts()}
wanted = sys.argv[1:] or list(found)
missing = [n for n in wanted if n not in found]
where = os.environ["MOE_MODEL_ARTIFACTS"]
if not found:
    sys.exit(f"error: {where} holds no artifact")
if missing:
    sys.exit(f"error: no artifact {' '.join(missing)} in {where}; found: {' '.join(found)}")
print("\n".join(str(found[n]) for n in wanted))
EOF
) || exit 2
mapfile -t arts <<<"$listing"
echo "artifacts: ${arts[*]}"

STEP_TAIL=40
source tests/gpu/steps.sh  # (the working directory is the repository root now)

if [[ " $steps " == *" tests "* ]]; then
    joined=$(IFS=:; echo "${arts[*]}")
    step models-tests env MOE_MODEL_ARTIFACTS="$joined" \
        "$py" -m pytest -q -s -rs -m gpu tests/gpu/test_models_gpu.py
fi
if [[ " $steps " == *" sanitize "* ]]; then
    # memcheck and racecheck of one bucket of each kernel for every artifact:
    # the mega kernel at M = 1 and the grouped kernel at M = 8 with finalize.
    for art in "${arts[@]}"; do
        name=$(basename "$art" .tar.zst)
        arch=$("$py" -c 'import torch; from runtime.constants import ARCH_OF
print(ARCH_OF[torch.cuda.get_device_capability()])' 2>/dev/null) || arch=sm_90a
        for v in "mega-$arch-m1-bfloat16" "grouped-$arch-m8-bfloat16-final"; do
            for tool in memcheck racecheck; do
                step "$tool-$name-$v" compute-sanitizer --tool "$tool" --error-exitcode 3 \
                    --kernel-name kns=moe_ "$py" tests/gpu/one_call.py "$art" "$v"
            done
        done
    done
fi
if [[ " $steps " == *" bench "* ]]; then
    for art in "${arts[@]}"; do
        name=$(basename "$art" .tar.zst)
        tokens=$("$py" -c 'import sys
from runtime.artifact import read
print(",".join(str(t) for t in sorted({v.tokens for v in read(sys.argv[1]).variants})))' "$art") \
            || { echo "error: cannot read $art"; [ $status -eq 0 ] && status=2; continue; }
        step "bench-$name" "$py" -m pipeline.cli bench "$art" --routing random \
            --tokens "$tokens" --reps "$reps" --json "$out/bench-$name.json"
    done
fi
exit $status

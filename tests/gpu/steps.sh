# Sourced by the GPU run scripts (acceptance.sh, models.sh): ``step NAME
# COMMAND...`` runs COMMAND with its output in "$out/NAME.log", prints the
# log's last $STEP_TAIL lines (default 25) and its exit status, and keeps
# the first failing status in $status (the script's exit status); it never
# stops the script. Needs $out set.
status=0
step() {  # name, command...
    local name=$1; shift
    echo "== $name"
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n "${STEP_TAIL:-25}" "$out/$name.log"
    echo "== $name: exit $rc"
    [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
    return 0
}

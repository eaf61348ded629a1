#!/usr/bin/env bash
# The repeat stage: the README's test command (its pytest part, the last command of the line after the
# test-command marker, as .ci/run finds it) N times with FLASHKD_TEST_SEED=random, fresh seeds every run:
#   bash scripts/repeat_suite.sh [N] [pytest arguments...]     N: 10 by default
# e.g. `bash scripts/repeat_suite.sh 3 -x tests/test_triton_rows.py`. PYTHON=... replaces the command's
# interpreter (.venv/bin/python: the venv the README's command makes). Prints each run's result and,
# for every failing test, the command that replays it; exits 1 if any run failed. Each run's log is
# kept in the folder printed first.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-10}
[ $# -gt 0 ] && shift
case $n in ''|*[!0-9]*) echo "repeat_suite.sh: N: expected a count, got '$n'" >&2; exit 2 ;; esac

line=$(awk 'index($0, "<!-- test-command") == 1 {on=1; next}
  on && /^```/ {if (started) exit; started=1; next}
  on && started && !/^#/ {print; exit}' README.md)
cmd=${line##*&& }
case $cmd in *"-m pytest"*) ;; *) echo "repeat_suite.sh: no pytest command at the end of README.md's test command" >&2; exit 2 ;; esac
if [ -n "${PYTHON:-}" ]; then cmd=${cmd/.venv\/bin\/python/$PYTHON}; fi

logs=$(mktemp -d "${TMPDIR:-/tmp}/flashkd-repeat.XXXXXX")
echo "repeat_suite.sh: $n runs of: FLASHKD_TEST_SEED=random $cmd $*  (logs in $logs)"
failed=0
for i in $(seq 1 "$n"); do
  log="$logs/run$i.log"
  FLASHKD_TEST_SEED=random bash -c "$cmd \"\$@\"" repeat_suite "$@" >"$log" 2>&1
  rc=$?
  result=$(grep -E '(passed|failed|error|no tests ran)' "$log" | tail -1)
  if [ "$rc" = 0 ]; then
    echo "run $i: pass: $result"
  else
    failed=$((failed + 1))
    echo "run $i: FAIL (exit $rc): $result"
    grep '^FLASHKD_TEST_SEED=' "$log" | sed 's/^/  /'  # the conftest's replay lines, one a failing test
  fi
done
echo "repeat_suite.sh: $failed of $n runs failed"
[ "$failed" = 0 ]

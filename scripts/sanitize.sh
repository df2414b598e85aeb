#!/usr/bin/env bash
# Builds torch_reccl instrumented by gcc's sanitizers and runs tests under them;
# fails on any sanitizer report (docs/sanitizers.md).
#
#   bash scripts/sanitize.sh address [pytest args]   # AddressSanitizer + UndefinedBehaviorSanitizer
#   bash scripts/sanitize.sh thread  [pytest args]   # ThreadSanitizer
#
# Without pytest args it runs the C++-heavy tests (SANITIZED_TESTS below).
# The instrumented build lives in a copy of the tree, build/sanitize/KIND (the
# normal build is never touched), so the tests' child processes, which put the
# repository they run from on PYTHONPATH, load the instrumented libraries too.
# Python is not instrumented: the sanitizer's runtime is preloaded into it.
# Every process writes its reports to build/sanitize/KIND-reports/; any file
# there fails the run, and the script prints them.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SANITIZED_TESTS=(tests/core tests/transport tests/engine tests/plugin tests/pg)

kind=${1:-}
case "$kind" in
    address) flags=address,undefined; runtime=libasan.so ;;
    thread) flags=thread; runtime=libtsan.so ;;
    *) echo "usage: bash scripts/sanitize.sh address|thread [pytest args]" \
            "(address: ASan+UBSan, thread: TSan), not '$kind'" >&2
       exit 2 ;;
esac
shift
[ $# -gt 0 ] || set -- "${SANITIZED_TESTS[@]}"

base=$REPO/build/sanitize
tree=$base/$kind
reports=$base/$kind-reports
mkdir -p "$tree"

# The copy: the tracked and untracked (not ignored) files, mtimes kept, so the
# copy's own build/ (ninja) rebuilds only what changed since the last run; the
# built libraries stay too (setuptools relinks only what is out of date).
find "$tree" -mindepth 1 ! -path "$tree/build/*" ! -name '*.so' -type f -delete
git ls-files -z --cached --others --exclude-standard |
    tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$tree"

start=$(date +%s)
echo "building the $flags variant in build/sanitize/$kind (log: build/sanitize/$kind-build.log)"
if ! (cd "$tree" && TORCH_RECCL_SANITIZE=$flags MAX_JOBS=${MAX_JOBS:-2} \
          python setup.py build_ext --inplace) >"$base/$kind-build.log" 2>&1; then
    tail -n 40 "$base/$kind-build.log" >&2
    echo "the $flags build failed (build/sanitize/$kind-build.log)" >&2
    exit 1
fi
echo "built in $(( $(date +%s) - start )) s"

rm -rf "$reports"
mkdir -p "$reports"
preload=$(gcc -print-file-name="$runtime")
[ -e "$preload" ] || { echo "gcc has no $runtime (install gcc's sanitizer runtimes)" >&2; exit 1; }
# libstdc++ right after the runtime: python does not link it, and the runtime's
# __cxa_throw interceptor, set up when the runtime starts, must find it then
# (else the first C++ exception aborts in the interceptor).
preload="$preload $(g++ -print-file-name=libstdc++.so.6)"
# detect_leaks=0: CPython and torch keep allocations for the process's lifetime
# by design, so LeakSanitizer would report them, not leaks of ours.
export ASAN_OPTIONS="detect_leaks=0:log_path=$reports/report:${ASAN_OPTIONS:-}"
# gcc's UBSan beside ASan ignores log_path: its reports go to stderr, and the
# build makes each one fatal, so no process that has one can pass.
export UBSAN_OPTIONS="print_stacktrace=1:${UBSAN_OPTIONS:-}"
export TSAN_OPTIONS="suppressions=$REPO/scripts/tsan.supp:second_deadlock_stack=1:log_path=$reports/report:${TSAN_OPTIONS:-}"
# The tests that check what the library links, or load it from a program of
# their own, allow for (and preload) the sanitizer's runtime.
export TORCH_RECCL_SANITIZE=$flags

set +e
(cd "$tree" && LD_PRELOAD="$preload" PYTHONPATH=$tree timeout "${SANITIZE_TIMEOUT:-3600}" \
     python -m pytest -q -p no:cacheprovider --capture=sys "$@") 2>&1 | tee "$base/$kind-pytest.log"
status=${PIPESTATUS[0]}
set -e

mapfile -t found < <(find "$reports" -type f | sort)
stderr_reports=$(grep -c "runtime error: \|ThreadSanitizer: \|AddressSanitizer: " "$base/$kind-pytest.log" || true)
if [ ${#found[@]} -gt 0 ] || [ "$stderr_reports" -gt 0 ]; then
    for file in "${found[@]}"; do
        echo "===== ${file#"$REPO"/}"
        cat "$file"
    done
    echo "${#found[@]} process(es) wrote sanitizer reports (build/sanitize/$kind-reports/);" \
         "$stderr_reports report line(s) in the run's output (build/sanitize/$kind-pytest.log)" >&2
    echo "sanitizer findings: FAILED" >&2
    exit 1
fi
echo "no sanitizer reports ($kind); pytest exit status $status"
exit $status

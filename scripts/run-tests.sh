#!/bin/sh
# Runs every test: all of them under ASan+UBSan (build-asan), the threaded
# stress tests also under TSan (build-tsan). Ends with the line
# "N passed, N failed".
#
# Where the time goes (scripts/test-times.py gives each test's CPU seconds):
# - both builds are optimised at -O1 (-g kept), as the sanitizers' own
#   documentation advises: the tests run in half the time of -O0, every check
#   still made;
# - the TSan build compiles only what its tests need (cca_tests_stress), the
#   ASan build every test program but not the benchmarks (cca_tests);
# - both are configured at once, and the two suites run at once, so that
#   neither one's longest test ends the run alone on an idle core.
set -u
JOBS=$(nproc 2>/dev/null || echo 2)

configure() { # build-dir, cmake flags
  cmake -S . -B "$1" -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_C_FLAGS_DEBUG=-g -O1" $2 \
    >"$1.configure.log" 2>&1
}

build() { # build-dir, target
  cmake --build "$1" -j "$JOBS" --target "$2" >"$1.build.log" 2>&1
}

suite() { # build-dir, ctest filter: runs the tests, leaves the log in build-dir/ctest.log
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir "$1" --output-on-failure -j "$JOBS" $2 >"$1/ctest.log" 2>&1
}

count() { # log, pattern
  grep -cE "$2" "$1"
}

status=0
passed=0
failed=0
echo "configuring build-asan (ASan+UBSan) and build-tsan (TSan)"
configure build-asan "-DCCA_SANITIZE=ON" & asan_cfg=$!
configure build-tsan "-DCCA_TSAN=ON" & tsan_cfg=$!
wait $asan_cfg; asan_ok=$?
wait $tsan_cfg; tsan_ok=$?
for d in asan tsan; do
  eval ok=\$${d}_ok
  if [ "$ok" -ne 0 ]; then
    cat "build-$d.configure.log"; echo "configure of build-$d failed"
    failed=$((failed + 1)); status=1
  fi
done
echo "building the test programs"
if [ "$asan_ok" -eq 0 ] && ! build build-asan cca_tests; then
  cat build-asan.build.log; echo "build of build-asan failed"
  failed=$((failed + 1)); status=1; asan_ok=1
fi
if [ "$tsan_ok" -eq 0 ] && ! build build-tsan cca_tests_stress; then
  cat build-tsan.build.log; echo "build of build-tsan failed"
  failed=$((failed + 1)); status=1; tsan_ok=1
fi
echo "running the tests (both suites at once; their logs follow)"
[ "$tsan_ok" -eq 0 ] && { suite build-tsan "-L stress" & tsan_run=$!; }
[ "$asan_ok" -eq 0 ] && suite build-asan ""
[ "$tsan_ok" -eq 0 ] && wait $tsan_run
for d in asan tsan; do
  eval ok=\$${d}_ok
  [ "$ok" -eq 0 ] || continue
  log=build-$d/ctest.log
  echo "== build-$d"
  cat "$log"
  p=$(count "$log" 'Test +#[0-9]+: .* +Passed')
  f=$(count "$log" 'Test +#[0-9]+: .*(\*\*\*Failed|\*\*\*Exception|\*\*\*Timeout|Not Run)')
  passed=$((passed + p)); failed=$((failed + f))
  [ "$f" -eq 0 ] || status=1
done
echo "$passed passed, $failed failed"
exit $status

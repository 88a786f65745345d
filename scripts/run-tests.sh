#!/bin/sh
# Runs every test: all of them under ASan+UBSan, the threaded stress tests
# also under TSan. Ends with the line "N passed, N failed".
set -u
JOBS=$(nproc 2>/dev/null || echo 2)
status=0
passed=0
failed=0

run_suite() { # build-dir, cmake flags, ctest filter
  dir=$1; flags=$2; filter=$3
  if ! cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Debug $flags >"$dir.configure.log" 2>&1; then
    cat "$dir.configure.log"; echo "configure of $dir failed"; failed=$((failed + 1)); status=1; return
  fi
  if ! cmake --build "$dir" -j "$JOBS" >"$dir.build.log" 2>&1; then
    cat "$dir.build.log"; echo "build of $dir failed"; failed=$((failed + 1)); status=1; return
  fi
  log="$dir/ctest.log"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir "$dir" --output-on-failure -j "$JOBS" $filter 2>&1 | tee "$log"
  p=$(grep -cE 'Test +#[0-9]+: .* +Passed' "$log")
  f=$(grep -cE 'Test +#[0-9]+: .*(\*\*\*Failed|\*\*\*Exception|\*\*\*Timeout|Not Run)' "$log")
  passed=$((passed + p)); failed=$((failed + f))
  [ "$f" -eq 0 ] || status=1
}

run_suite build-asan "-DCCA_SANITIZE=ON" ""
run_suite build-tsan "-DCCA_TSAN=ON" "-L stress"
echo "$passed passed, $failed failed"
exit $status

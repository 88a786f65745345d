#!/bin/sh
# Builds the libFuzzer targets (clang, ASan+UBSan, coverage instrumentation)
# in build-fuzz and runs every tests/fuzz/fuzz_<name>.c for FUZZ_SECONDS
# seconds each (default 60), seeded with tests/fuzz/corpus/<name>/. New
# inputs go to build-fuzz/corpus/<name>/ (the committed corpus is not
# touched); crashes to build-fuzz/crashes/<name>/. To keep an interesting
# input, copy it into tests/fuzz/corpus/<name>/ (or run with -merge=1).
# Ends with one line per target: executions, and whether it crashed.
set -u
CC=${CC:-clang-14}
command -v "$CC" >/dev/null 2>&1 || CC=clang
SECONDS_EACH=${FUZZ_SECONDS:-60}
JOBS=${FUZZ_JOBS:-2}
dir=build-fuzz
if ! CC=$CC cmake -S . -B $dir -DCMAKE_BUILD_TYPE=Debug -DCCA_SANITIZE=ON -DCCA_LIBFUZZER=ON \
      "-DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link -fsanitize-coverage-ignorelist=$PWD/tests/fuzz/coverage-ignore.txt" >$dir.configure.log 2>&1; then
  cat $dir.configure.log; echo "configure of $dir failed"; exit 1
fi
targets=""
for src in tests/fuzz/fuzz_*.c; do
  targets="$targets $(basename "$src" .c)"
done
# shellcheck disable=SC2086
if ! cmake --build $dir -j "$JOBS" --target $targets >$dir.build.log 2>&1; then
  cat $dir.build.log; echo "build of $dir failed"; exit 1
fi
status=0
summary=""
for t in $targets; do
  name=${t#fuzz_}
  mkdir -p "$dir/corpus/$name" "$dir/crashes/$name"
  log="$dir/$t.log"
  CCA_BACKEND=sim ASAN_OPTIONS=detect_leaks=1 "$dir/fuzz/$t" -max_total_time="$SECONDS_EACH" \
    -print_final_stats=1 -artifact_prefix="$dir/crashes/$name/" \
    "$dir/corpus/$name" "tests/fuzz/corpus/$name" >"$log" 2>&1
  rc=$?
  execs=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}')
  if [ $rc -ne 0 ]; then
    status=1
    tail -40 "$log"
    summary="$summary
$t: CRASHED after ${execs:-?} executions (see $log)"
  else
    summary="$summary
$t: ${execs:-?} executions in ${SECONDS_EACH}s, no crash"
  fi
done
echo "$summary"
exit $status

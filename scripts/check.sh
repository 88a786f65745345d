#!/bin/sh
# The edit loop's quick check (`make check`): the unit tests (ctest label
# unit), built without sanitizers in build-check, run in parallel. `make test`
# runs these and every other test under the sanitizers. Ends with the line
# "N passed, N failed".
set -u
JOBS=$(nproc 2>/dev/null || echo 2)
dir=build-check
if ! cmake -S . -B $dir -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_C_FLAGS_DEBUG=-g -O1" >$dir.configure.log 2>&1; then
  cat $dir.configure.log; echo "configure of $dir failed"; echo "0 passed, 1 failed"; exit 1
fi
if ! cmake --build $dir -j "$JOBS" --target cca_tests_unit >$dir.build.log 2>&1; then
  cat $dir.build.log; echo "build of $dir failed"; echo "0 passed, 1 failed"; exit 1
fi
log=$dir/ctest.log
ctest --test-dir $dir --output-on-failure -j "$JOBS" -L unit >"$log" 2>&1
status=$?
cat "$log"
p=$(grep -cE 'Test +#[0-9]+: .* +Passed' "$log")
f=$(grep -cE 'Test +#[0-9]+: .*(\*\*\*Failed|\*\*\*Exception|\*\*\*Timeout|Not Run)' "$log")
echo "$p passed, $f failed"
[ "$status" -eq 0 ] && [ "$f" -eq 0 ]

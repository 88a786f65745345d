#!/bin/sh
# Builds every tests/fuzz/fuzz_<name>.c as a libFuzzer binary (clang,
# -fsanitize=fuzzer,address,undefined) and runs each for FUZZ_SECONDS
# (default 60) on a copy of its corpus (tests/fuzz/corpus/<name>/), printing
# the executions. Crash inputs land in build-fuzz/artifacts/<name>/; add them
# to the corpus once fixed. Exits non-zero if any target fails.
set -u
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
CC_FUZZ=${CC_FUZZ:-$(command -v clang-14 || command -v clang)}
dir=build-fuzz
[ -n "$CC_FUZZ" ] || { echo "fuzz: clang not found"; exit 1; }
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER="$CC_FUZZ" \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCCA_LIBFUZZER=ON -DCCA_WITH_CUDA=OFF >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; exit 1; }
status=0
for src in tests/fuzz/fuzz_*.c; do
  [ -e "$src" ] || continue
  name=$(basename "$src" .c)
  short=${name#fuzz_}
  if ! cmake --build "$dir" -j 2 --target "$name" >"$dir.build.log" 2>&1; then
    cat "$dir.build.log"; echo "fuzz: build of $name failed"; status=1; continue
  fi
  work="$dir/corpus/$short"
  art="$dir/artifacts/$short"
  mkdir -p "$work" "$art"
  [ -d "tests/fuzz/corpus/$short" ] && cp -n "tests/fuzz/corpus/$short"/* "$work"/ 2>/dev/null
  log="$dir/$name.log"
  ASAN_OPTIONS=detect_leaks=1 "$dir/fuzz/$name" -max_total_time="$FUZZ_SECONDS" -timeout=10 \
    -rss_limit_mb=2048 -artifact_prefix="$art/" -print_final_stats=1 "$work" >"$log" 2>&1
  rc=$?
  runs=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}')
  echo "$name: ${runs:-?} executions in ${FUZZ_SECONDS}s, exit $rc"
  if [ $rc -ne 0 ]; then
    tail -40 "$log"; echo "fuzz: $name failed; inputs in $art/"; status=1
  fi
done
exit $status

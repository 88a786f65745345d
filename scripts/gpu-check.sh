#!/bin/bash
# gpu-check.sh - check cca on a machine with a GPU, PyTorch and the CUDA toolkit,
# and compare it with the anchors in one run:
#   1. build cca (Release; and Debug without ASan, for compute-sanitizer);
#   2. run the GPU test suite (ctest -L cuda; with two GPUs it includes peer
#      access and two processes sharing memory, test_cuda_multigpu; two
#      processes sharing blocks of expandable segments, test_cuda_ipc_expandable);
#   3. run each GPU test binary under compute-sanitizer --tool memcheck;
#   3b. with two GPUs: two-rank NCCL data-parallel training on cca against
#      the native run (tests/cuda/torch_ddp.py);
#   4. run the anchor benchmark (.anchor/run.sh: PyTorch native, PyTorch
#      expandable segments, cudaMallocAsync, cudaMalloc) and cca's bench_gpu
#      (default, relaxed statistics, expandable segments),
#      bench_host, bench_floor (the random workload through PyTorch's
#      placement alone, beside cca) and bench_replay (the replay against
#      Python's unpickler);
#   5. run PyTorch on cca: the pluggable path, the C++ adapter
#      (tests/cuda/torch_adapter.py), CUDA tensors shared between processes
#      through it (tests/cuda/torch_ipc.py) and torch.compile's CUDA graph
#      trees (tests/cuda/torch_compile.py), both only with GPU_CHECK_BUDGET >=
#      600, with two GPUs peer access (tests/cuda/torch_peer.py), and
#      bench/torch_bench.py (below a 600 s budget without BERT and ViT);
#   5b. CuPy and Numba on cca (tests/cuda/cupy_numba.py, from the build tree);
#   6. print one comparison table.
# A failing step is reported and the script goes on to the table; the exit
# status is 1 if any step failed. Every step has a time limit so the whole
# run ends within about 8 minutes. Logs go under $OUT (else ./gpu-check-out).
#
# Usage: scripts/gpu-check.sh        (from anywhere; builds in build-gpu-*)
# Environment: OUT (log folder), JOBS (build parallelism), GPU_CHECK_BUDGET
# (seconds for the whole run, default 480), GPU_CHECK_ONLY (a short run of
# one part, then exit):
#   GPU_CHECK_ONLY=multigpu  the multi-GPU and multi-process parts only, for a
#     two-GPU machine: build the library and those tests (Release), run
#     test_cuda_multigpu, test_cuda_ipc_expandable and test_cuda_async_graphs,
#     then PyTorch on cca's cudaMallocAsync backend against PyTorch's own
#     (torch_adapter.py --job train-resnet50-async, one GPU), the annotations
#     (with two GPUs, one made on the second) and the pinned memory through
#     PyTorch (--job annotations, --job pinned), CUDA tensors between
#     processes (torch_ipc.py, one GPU), the two-rank NCCL runs (torch_ddp.py;
#     torch_nccl.py: DDP and FSDP2 on the adapter with NCCL's registration hook
#     and a MemPool of ncclMemAlloc memory registered with the process group)
#     and peer access through PyTorch's copies and CuPy kernels
#     (torch_peer.py); about 4-6 minutes.
#   GPU_CHECK_ONLY=torch-compile  torch.compile(mode="reduce-overhead") only:
#     build the library (Release, and Release with the checker after every
#     call), then tests/cuda/torch_compile.py (CUDA graph trees' checkpoints
#     through the adapter against native, then on the checked library; then
#     the same with expandable segments on both sides).
#   GPU_CHECK_ONLY=pytorch-tests  PyTorch's own test/test_cuda.py (its memory,
#     allocator, graph, pool, snapshot and pinned-memory tests, selected with
#     pytest -k) natively and with cca, each without and with expandable
#     segments (scripts/pytorch_tests.py --parallel): build the library
#     (Release), then the four pytest runs at once on the GPU (two pytest
#     processes each), then each test that passed natively and not with cca
#     run again alone, serially, natively and with cca (a test disturbed by
#     the concurrent runs is not a regression); one table of final results
#     (re-run ones marked *), and for each regression left the end of its
#     failure report. The test file is upstream code, kept out of the
#     repository in .pytorch-tests/ (copy it there); about 5.5 minutes: the
#     step takes what the budget leaves (the runs at once stop a quarter of
#     it, at most 120 s, before its end, for the re-runs); give it
#     GPU_CHECK_BUDGET=400 or more. PYTORCH_TEST_FILES="PATH[:EXPR] ..." runs
#     other test files of .pytorch-tests/ instead (scripts/pytorch_tests.py
#     --file), e.g. "test_cuda_trace.py profiler/test_memory_profiler.py"; a
#     file as long as test_cuda.py's selection takes a run of its own.
#   GPU_CHECK_ONLY=torch-hooks  PyTorch's hooks around the allocator, cca
#     against native (tests/cuda/torch_hooks.py: torch.accelerator's memory
#     functions, caching_allocator_enable, PYTORCH_NO_CUDA_MEMORY_CACHING,
#     PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF together, either set
#     after install and before CUDA starts, per_process_memory_fraction from
#     them, the profiler, GPU trace, snapshot settings and entries, trace
#     trackers' pool ids); about 2.5 minutes.
#   GPU_CHECK_ONLY=compact  compact_memory:True only: build the library and
#     test_cuda_expandable (Release), run it (its compact tests print the moves
#     and the growths that took new memory past pending granules), then
#     bench/torch_bench.py (PyTorch native, native expandable, cca and cca
#     compact: step times, peak reserved, the compact run's moves, growths past
#     pending granules and synchronisations); about 4-6 minutes (give it
#     GPU_CHECK_BUDGET=600).
#   GPU_CHECK_ONLY=python-ecosystem  CuPy and Numba on cca only: build the library
#     (Release), run tests/cuda/cupy_numba.py from the build tree, then from a
#     `cmake --install` prefix (its smoke part), then bench/python_ecosystem_bench.py
#     (allocate + free from Python: cca beside CuPy's pool, Numba's default and RMM's
#     where installed); about 2-3 minutes.
# shellcheck disable=SC2317,SC2046  # functions run through timeout; -k flags split on purpose
set -u -o pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
logs=${OUT:-$root/gpu-check-out}
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
jobs=${JOBS:-$(nproc 2>/dev/null || echo 4)}
budget=${GPU_CHECK_BUDGET:-480}
start=$SECONDS
failed_steps=()
step_lines=()

# Seconds left in the budget, keeping reserve seconds for later steps.
left() {
    local reserve=$1
    local n=$((budget - (SECONDS - start) - reserve))
    [ "$n" -lt 20 ] && n=20
    echo "$n"
}

# run_step NAME LIMIT CMD...: run CMD with a time limit, output to $logs/NAME.log.
run_step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS rc
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$logs/$name.log" 2>&1
    rc=$?
    local dt=$((SECONDS - t0))
    if [ $rc -eq 0 ]; then
        step_lines+=("$(printf '%-28s PASS  %4ds' "$name" "$dt")")
    else
        local why="exit $rc"
        [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="timed out after ${limit}s"
        step_lines+=("$(printf '%-28s FAIL  %4ds  %s (see %s)' "$name" "$dt" "$why" "$logs/$name.log")")
        failed_steps+=("$name")
        echo "   FAILED ($why); last lines of $logs/$name.log:"
        tail -n 15 "$logs/$name.log" | sed 's/^/   | /'
    fi
    return $rc
}

# Build steps keep going past a target that fails, so the others still build.
keep_going() { # the native tool's keep-going flag for build folder $1
    if [ -f "$1/build.ninja" ]; then echo "-k 0"; else echo "-k"; fi
}
build_release() {
    cmake -S "$root" -B "$root/build-gpu-release" -DCMAKE_BUILD_TYPE=Release -DCCA_SANITIZE=OFF -DCCA_WERROR=OFF &&
        cmake --build "$root/build-gpu-release" -j "$jobs" -- $(keep_going "$root/build-gpu-release")
}
build_debug() {
    cmake -S "$root" -B "$root/build-gpu-debug" -DCMAKE_BUILD_TYPE=Debug -DCCA_SANITIZE=OFF -DCCA_WERROR=OFF \
        -DCCA_DEBUG_LEVEL=2 || return 1
    local rc=0 src t
    for src in "$root"/tests/cuda/test_*.c; do
        [ -f "$src" ] || continue
        t=cuda_$(basename "$src" .c)
        cmake --build "$root/build-gpu-debug" -j "$jobs" --target "$t" || rc=1
    done
    return $rc
}
run_ctest() {
    ctest --test-dir "$root/build-gpu-release" -L cuda --output-on-failure --timeout 150
}
# memcheck BINARY: real memory errors and leaks fail; the CUDA API errors that
# the tests provoke on purpose (bad pointers, out of memory) are not reported.
memcheck() {
    "$sanitizer" --tool memcheck --leak-check full --report-api-errors no --error-exitcode 9 "$1"
    local rc=$?
    [ $rc -eq 77 ] && return 0 # skipped: no GPU
    return $rc
}
run_torch() {
    python3 "$root/tests/cuda/torch_pluggable.py" "$root/build-gpu-release/libcca.so"
}
# Two ranks of torch.distributed (NCCL) on cca against the native run; needs 2 GPUs.
run_torch_ddp() {
    python3 "$root/tests/cuda/torch_ddp.py" "$root/build-gpu-release/libcca.so"
}
# Two ranks on the adapter against native: DDP and FSDP2 with NCCL's registration hook, and a
# MemPool of ncclMemAlloc memory registered with the process group; needs 2 GPUs.
run_torch_nccl() {
    CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" \
        python3 "$root/tests/cuda/torch_nccl.py" "$root/build-gpu-release/libcca.so"
}
# The threaded workloads spread over two GPUs, on both backends; needs 2 GPUs.
run_bench_2gpu() {
    "$root/build-gpu-release/bench/bench_gpu" --quick --devices 2 --name cca-2gpu &&
        CCA_ALLOC_CONF=backend:cudaMallocAsync "$root/build-gpu-release/bench/bench_gpu" --quick \
            --devices 2 --name cca-async-2gpu
}
# adapter_jobs: --job arguments (empty: every part).
run_torch_adapter() {
    CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" \
        python3 "$root/tests/cuda/torch_adapter.py" "$root/build-gpu-release/libcca.so" $adapter_jobs
}
# PyTorch on cca's cudaMallocAsync backend against PyTorch's own (three training processes),
# then the annotations and pinned memory through PyTorch.
run_torch_adapter_async() {
    CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" \
        python3 "$root/tests/cuda/torch_adapter.py" "$root/build-gpu-release/libcca.so" --job train-resnet50-async \
        --job annotations --job pinned
}
# PyTorch's hooks around its allocator (torch.accelerator, caching_allocator_enable, the
# profiler, GPU trace, snapshot settings), cca against native.
run_torch_hooks() {
    CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" \
        python3 "$root/tests/cuda/torch_hooks.py" "$root/build-gpu-release/libcca.so"
}
# run_pytorch_tests SECONDS: PyTorch's test_cuda.py memory tests (or PYTORCH_TEST_FILES' files),
# four ways at once, differing tests re-run alone (one table).
run_pytorch_tests() {
    local files=()
    for f in ${PYTORCH_TEST_FILES:-}; do files+=(--file "$f"); done
    CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" OUT="$logs" \
        python3 "$root/scripts/pytorch_tests.py" "$root/build-gpu-release/libcca.so" --parallel \
        --budget "$1" "${files[@]}"
}
build_library() {
    cmake -S "$root" -B "$root/build-gpu-release" -DCMAKE_BUILD_TYPE=Release -DCCA_SANITIZE=OFF -DCCA_WERROR=OFF &&
        cmake --build "$root/build-gpu-release" -j "$jobs" --target cca_shared
}
# torch.multiprocessing CUDA tensors through the adapter, both processes on cca.
run_torch_ipc() {
    CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" \
        python3 "$root/tests/cuda/torch_ipc.py" "$root/build-gpu-release/libcca.so"
}
# torch.compile(mode="reduce-overhead"): CUDA graph trees' checkpoints through the adapter,
# against native; the cca side again on a library whose checker runs after every call.
build_checked() {
    cmake -S "$root" -B "$root/build-gpu-checked" -DCMAKE_BUILD_TYPE=Release -DCCA_SANITIZE=OFF \
        -DCCA_WERROR=OFF -DCCA_DEBUG_LEVEL=3 &&
        cmake --build "$root/build-gpu-checked" -j "$jobs" --target cca_shared
}
# run_torch_compile [CHECKED_LIB]: with the library build_checked made in this run; then
# again with expandable segments on both sides (checkpoints of expandable pools)
run_torch_compile() {
    local checked=()
    [ $# -gt 0 ] && checked=(--checked "$1")
    CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" \
        python3 "$root/tests/cuda/torch_compile.py" "$root/build-gpu-release/libcca.so" "${checked[@]}" &&
        CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" \
            python3 "$root/tests/cuda/torch_compile.py" "$root/build-gpu-release/libcca.so" "${checked[@]}" \
            --expandable
}
# Peer access through PyTorch's copies and direct kernel reads, cca and native; needs 2 GPUs.
run_torch_peer() {
    CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" \
        python3 "$root/tests/cuda/torch_peer.py" "$root/build-gpu-release/libcca.so"
}
run_torch_bench() {
    CCA_TORCH_BUILD_DIR="$root/build-gpu-release/torch-adapter" \
        python3 "$root/bench/torch_bench.py" "$root/build-gpu-release/libcca.so" --repeat 1 "$@"
}
run_anchor() {
    OUT="$logs" bash "$root/.anchor/run.sh"
}
run_bench() {
    "$root/build-gpu-release/bench/bench_gpu"
}
run_bench_relaxed() {
    CCA_ALLOC_CONF=exact_peak_stats:False "$root/build-gpu-release/bench/bench_gpu" --name cca-relaxed
}
run_bench_expandable() {
    CCA_ALLOC_CONF=expandable_segments:True "$root/build-gpu-release/bench/bench_gpu" --name cca-expandable
}
run_bench_sim() {
    "$root/build-gpu-release/bench/bench_gpu" --backend sim --name cca-sim
}
run_bench_host() {
    "$root/build-gpu-release/bench/bench_host" --backend cuda
}
run_bench_floor() {
    "$root/build-gpu-release/bench/bench_floor"
}
run_bench_replay() {
    "$root/build-gpu-release/bench/bench_replay" --runs 5
}

# GPU_CHECK_ONLY=multigpu: just what the multi-GPU run needs.
multigpu_tests='^cuda_test_cuda_(multigpu|ipc_expandable|async_graphs)$'
build_multigpu() {
    cmake -S "$root" -B "$root/build-gpu-release" -DCMAKE_BUILD_TYPE=Release -DCCA_SANITIZE=OFF -DCCA_WERROR=OFF ||
        return 1
    local rc=0 t
    for t in cca_shared cuda_test_cuda_multigpu cuda_test_cuda_ipc_expandable cuda_test_cuda_async_graphs; do
        cmake --build "$root/build-gpu-release" -j "$jobs" --target "$t" || rc=1
    done
    return $rc
}
run_ctest_multigpu() {
    ctest --test-dir "$root/build-gpu-release" -R "$multigpu_tests" --output-on-failure --timeout 150 -V
}
export multigpu_tests
export -f build_multigpu run_ctest_multigpu

# CuPy and Numba on cca (tests/cuda/cupy_numba.py): from the build tree, and from an installed prefix.
run_python_ecosystem() {
    PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
        python3 "$root/tests/cuda/cupy_numba.py" "$root/build-gpu-release/libcca.so"
}
run_python_ecosystem_installed() {
    local prefix="$root/build-gpu-release/install-prefix" site
    rm -rf "$prefix"
    cmake --install "$root/build-gpu-release" --prefix "$prefix" || return 1
    for site in "$prefix"/lib/python3*/site-packages; do break; done
    [ -d "$site" ] || { echo "no site-packages under $prefix"; return 1; }
    (cd / && env -u CCA_LIBRARY PYTHONPATH="$site" CCA_EXPECT_PREFIX="$prefix" \
        python3 "$root/tests/cuda/cupy_numba.py" --part smoke)
}
run_python_ecosystem_bench() {
    PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
        python3 "$root/bench/python_ecosystem_bench.py" "$root/build-gpu-release/libcca.so"
}
build_python_ecosystem() {
    cmake -S "$root" -B "$root/build-gpu-release" -DCMAKE_BUILD_TYPE=Release -DCCA_SANITIZE=OFF -DCCA_WERROR=OFF ||
        return 1
    cmake --build "$root/build-gpu-release" -j "$jobs" --target cca_static cca_shared cca_cli
}
export -f run_python_ecosystem run_python_ecosystem_installed run_python_ecosystem_bench build_python_ecosystem

# GPU_CHECK_ONLY=compact: the compact_memory GPU tests and the PyTorch step times.
build_compact() {
    cmake -S "$root" -B "$root/build-gpu-release" -DCMAKE_BUILD_TYPE=Release -DCCA_SANITIZE=OFF -DCCA_WERROR=OFF ||
        return 1
    local rc=0 t
    for t in cca_shared cuda_test_cuda_expandable; do
        cmake --build "$root/build-gpu-release" -j "$jobs" --target "$t" || rc=1
    done
    return $rc
}
run_ctest_compact() {
    ctest --test-dir "$root/build-gpu-release" -R '^cuda_test_cuda_expandable$' --output-on-failure --timeout 150 -V
}
export -f build_compact run_ctest_compact

export root logs jobs
export -f keep_going build_release build_debug build_checked run_ctest memcheck run_torch run_torch_ddp run_torch_adapter run_torch_adapter_async run_torch_ipc run_torch_compile run_torch_peer run_torch_hooks run_pytorch_tests build_library run_torch_nccl run_torch_bench run_anchor run_bench run_bench_relaxed run_bench_expandable run_bench_sim run_bench_host run_bench_floor run_bench_replay

{
    echo "gpu-check: $(date -u '+%Y-%m-%d %H:%M:%S UTC') in $root"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
    python3 -c 'import torch; print("torch:", torch.__version__)' 2>&1 | tail -1
    nvcc --version 2>/dev/null | tail -1 || /usr/local/cuda/bin/nvcc --version 2>/dev/null | tail -1
} | tee "$logs/environment.log"

# A run's end: only_steps lists a GPU_CHECK_ONLY run's steps; the caller then prints the
# lines of its logs that say what was checked, and finish_run the time and the exit status.
only_steps() {
    echo
    echo "Steps (GPU_CHECK_ONLY=$GPU_CHECK_ONLY):"
    printf '  %s\n' "${step_lines[@]}" | tee "$logs/steps.txt"
}
finish_run() {
    echo "logs: $logs  (total $((SECONDS - start))s)"
    if [ ${#failed_steps[@]} -gt 0 ]; then
        echo "gpu-check: FAILED steps: ${failed_steps[*]}"
        exit 1
    fi
    echo "gpu-check: all steps passed"
    exit 0
}

case "${GPU_CHECK_ONLY:-}" in
"") ;;
multigpu)
    gpu_count=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
    run_step build-multigpu "$(left 200)" build_multigpu
    run_step ctest-multigpu "$(left 120)" run_ctest_multigpu
    run_step torch-adapter-async "$(left 240)" run_torch_adapter_async
    run_step torch-ipc "$(left 180)" run_torch_ipc
    if [ "${gpu_count:-0}" -ge 2 ]; then
        run_step torch-ddp-2gpu "$(left 120)" run_torch_ddp
        run_step torch-nccl-2gpu "$(left 90)" run_torch_nccl
        run_step torch-peer-2gpu "$(left 0)" run_torch_peer
    else
        echo "== torch-ddp-2gpu: needs two GPUs (${gpu_count:-0} here)"
        step_lines+=("$(printf '%-28s FAIL  needs two GPUs, %s here' torch-ddp-2gpu "${gpu_count:-0}")")
        failed_steps+=(torch-ddp-2gpu)
    fi
    only_steps
    # each test's lines and ctest's verdict (a skipped test, e.g. with one GPU, says so here)
    grep -E '^[0-9]+/[0-9]+ Test +#|^[0-9]+: (ok |FAIL|SKIPPED|no usable GPU|[0-9]+ passed)' \
        "$logs/ctest-multigpu.log" 2>/dev/null | sed 's/^/  /'
    grep -E '^(PASS|FAIL)' "$logs/torch-nccl-2gpu.log" "$logs/torch-peer-2gpu.log" 2>/dev/null | sed 's/^/  /'
    finish_run
    ;;
torch-compile)
    run_step build-release "$(left 300)" build_release
    run_step build-checked "$(left 240)" build_checked
    run_step torch-compile "$(left 0)" run_torch_compile "$root/build-gpu-checked/libcca.so"
    only_steps
    grep -E '^(PASS|FAIL)|^adapter|^native|^cca with' "$logs/torch-compile.log" 2>/dev/null | sed 's/^/  /'
    finish_run
    ;;
pytorch-tests)
    run_step build-library "$(left 360)" build_library
    # the pytest runs stop themselves 20 s before the step's limit
    limit=$(left 0)
    run_step pytorch-tests "$limit" run_pytorch_tests "$((limit - 20))"
    only_steps
    grep -E '^(native|cca|expecttest|adapter|the [0-9] runs|re-run|  (native|cca))' "$logs/pytorch-tests.log" \
        2>/dev/null | sed 's/^/  /'
    sed -n '/^| test /,$p' "$logs/pytorch-tests.log" 2>/dev/null
    finish_run
    ;;
torch-hooks)
    run_step build-library "$(left 200)" build_library
    run_step torch-hooks "$(left 0)" run_torch_hooks
    only_steps
    grep -E '^(PASS|FAIL)|differences' "$logs/torch-hooks.log" 2>/dev/null | cut -c1-400 | sed 's/^/  /'
    finish_run
    ;;
compact)
    run_step build-compact "$(left 200)" build_compact
    run_step ctest-compact "$(left 150)" run_ctest_compact
    run_step torch-bench "$(left 0)" run_torch_bench
    only_steps
    grep -E '^[0-9]+: (ok |FAIL|  busy stream|  idle stream|[0-9]+ passed)' "$logs/ctest-compact.log" 2>/dev/null |
        sed 's/^/  /'
    grep -E '^\| |^cca compact' "$logs/torch-bench.log" 2>/dev/null | sed 's/^/  /'
    finish_run
    ;;
python-ecosystem)
    run_step build-python-ecosystem "$(left 150)" build_python_ecosystem
    run_step python-ecosystem "$(left 90)" run_python_ecosystem
    run_step python-ecosystem-installed "$(left 60)" run_python_ecosystem_installed
    run_step python-ecosystem-bench "$(left 0)" run_python_ecosystem_bench
    only_steps
    grep -E '^(PASS|FAIL|SKIPPED|part |python-ecosystem:)' "$logs/python-ecosystem.log" \
        "$logs/python-ecosystem-installed.log" 2>/dev/null | sed 's/^/  /'
    grep -E '^\| |^SKIPPED|^FAILED' "$logs/python-ecosystem-bench.log" 2>/dev/null | sed 's/^/  /'
    finish_run
    ;;
*)
    echo "gpu-check: unknown GPU_CHECK_ONLY=$GPU_CHECK_ONLY (known: multigpu, compact, torch-compile," \
        "pytorch-tests, torch-hooks, python-ecosystem)" >&2
    exit 2
    ;;
esac

run_step build-release "$(left 300)" build_release
run_step build-debug "$(left 280)" build_debug
run_step ctest-cuda "$(left 240)" run_ctest

sanitizer=/usr/local/cuda/bin/compute-sanitizer
[ -x "$sanitizer" ] || sanitizer=$(command -v compute-sanitizer || true)
export sanitizer
if [ -z "$sanitizer" ]; then
    echo "== memcheck: compute-sanitizer not found"
    step_lines+=("$(printf '%-28s FAIL  compute-sanitizer not found' memcheck)")
    failed_steps+=(memcheck)
else
    found=0
    for bin in "$root"/build-gpu-debug/cuda_test_*; do
        [ -x "$bin" ] || continue
        found=1
        name=$(basename "$bin")
        run_step "memcheck-${name#cuda_}" "$(left 200)" memcheck "$bin"
    done
    if [ $found -eq 0 ]; then
        step_lines+=("$(printf '%-28s FAIL  no GPU test binary was built' memcheck)")
        failed_steps+=(memcheck)
    fi
fi

run_step torch-pluggable "$(left 220)" run_torch
run_step python-ecosystem "$(left 200)" run_python_ecosystem
# cudaMallocAsync under PyTorch (three ResNet-50 trainings, about 70 s), the annotations and
# the pinned memory (about 60 s) only with a budget of 600 s or more; GPU_CHECK_ONLY=multigpu
# runs them.
if [ "$budget" -ge 600 ]; then
    adapter_jobs=""
else
    adapter_jobs="--job functions --job free-memory-callbacks --job runtime-settings --job backend-name"
    adapter_jobs="$adapter_jobs --job train-resnet50"
    adapter_jobs="$adapter_jobs --job train-gpt2 --job train-resnet50-expandable"
    echo "== torch-adapter: train-resnet50-async, annotations and pinned skipped (GPU_CHECK_BUDGET below 600;" \
        "GPU_CHECK_ONLY=multigpu runs them)"
fi
export adapter_jobs
run_step torch-adapter "$(left 150)" run_torch_adapter
# PyTorch's hooks around the allocator (about 2 minutes): in the full run only with a budget of
# 600 s or more; GPU_CHECK_ONLY=torch-hooks runs it.
if [ "$budget" -ge 600 ]; then
    run_step torch-hooks "$(left 140)" run_torch_hooks
else
    echo "== torch-hooks: skipped (GPU_CHECK_BUDGET below 600; GPU_CHECK_ONLY=torch-hooks runs it)"
fi
# CUDA tensors between processes through PyTorch (about 50 s): in the full run only with a
# budget of 600 s or more; GPU_CHECK_ONLY=multigpu runs it.
if [ "$budget" -ge 600 ]; then
    run_step torch-ipc "$(left 140)" run_torch_ipc
else
    echo "== torch-ipc: skipped (GPU_CHECK_BUDGET below 600; GPU_CHECK_ONLY=multigpu runs it)"
fi
# torch.compile takes about 90 s a way, without and with expandable segments (three
# processes each compile or load their kernels): in the full run only with a budget of 600 s
# or more; GPU_CHECK_ONLY=torch-compile runs it alone.
if [ "$budget" -ge 600 ]; then
    run_step torch-compile "$(left 130)" run_torch_compile
else
    echo "== torch-compile: skipped (GPU_CHECK_BUDGET below 600; GPU_CHECK_ONLY=torch-compile runs it)"
fi
gpu_count=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
if [ "${gpu_count:-0}" -ge 2 ]; then
    run_step torch-ddp-2gpu "$(left 150)" run_torch_ddp
    run_step torch-peer-2gpu "$(left 140)" run_torch_peer
else
    echo "== torch-ddp-2gpu: skipped (${gpu_count:-0} GPU)"
fi

if [ -f "$root/.anchor/run.sh" ]; then
    run_step anchor "$(left 70)" run_anchor
else
    echo "== anchor: $root/.anchor/run.sh is missing (copy the anchor folder there)"
    step_lines+=("$(printf '%-28s FAIL  .anchor/run.sh missing' anchor)")
    failed_steps+=(anchor)
fi
if [ -x "$root/build-gpu-release/bench/bench_gpu" ]; then
    run_step bench-cca "$(left 10)" run_bench
else
    step_lines+=("$(printf '%-28s FAIL  bench_gpu was not built' bench-cca)")
    failed_steps+=(bench-cca)
fi

# ---- the comparison table -------------------------------------------------
if [ -x "$root/build-gpu-release/bench/bench_gpu" ]; then
    run_step bench-cca-relaxed "$(left 8)" run_bench_relaxed
    run_step bench-cca-expandable "$(left 7)" run_bench_expandable
    run_step bench-cca-sim "$(left 6)" run_bench_sim
fi
if [ -x "$root/build-gpu-release/bench/bench_floor" ]; then
    run_step bench-floor "$(left 5)" run_bench_floor
fi
if [ -x "$root/build-gpu-release/bench/bench_host" ]; then
    run_step bench-host "$(left 5)" run_bench_host
fi
if [ "${gpu_count:-0}" -ge 2 ] && [ -x "$root/build-gpu-release/bench/bench_gpu" ]; then
    run_step bench-2gpu "$(left 3)" run_bench_2gpu
fi
if [ -x "$root/build-gpu-release/bench/bench_replay" ]; then
    run_step bench-replay "$(left 4)" run_bench_replay
fi
# PyTorch's step times: below a 600 s budget without the two models whose shapes change at
# every step (--short; GPU_CHECK_ONLY=compact runs them all)
if [ "$budget" -ge 600 ]; then
    run_step torch-bench "$(left 0)" run_torch_bench
else
    run_step torch-bench "$(left 0)" run_torch_bench --short
fi

cat "$logs"/anchor.log "$logs"/bench-cca.log "$logs"/bench-cca-relaxed.log "$logs"/bench-cca-expandable.log \
    "$logs"/bench-host.log \
    2>/dev/null | grep '^RESULT ' >"$logs/results.txt"
awk '
function key(name, rest) { return name "|" rest }
$1 == "RESULT" {
    name = $2; what = $3; value = $NF; sub(/^[^=]*=/, "", value)
    if (what == "pair_latency") { split($4, kv, "="); what = "pair_" kv[2] }
    if (what == "pinned_pair") { split($4, kv, "="); what = "pinned_" kv[2] }
    if (name == "cuda") { name = "cca"; what = "query_" what } # (the device question: cca column)
    v[key(name, what)] = value
}
function cell(name, what) { return (key(name, what) in v) ? v[key(name, what)] : "-" }
function ratio(what,   a, b) {
    a = cell("cca", what); b = cell("torch-native", what)
    if (a == "-" || b == "-" || b + 0 == 0) return "-"
    return sprintf("%.3f", a / b)
}
function row(label, what, unit) {
    printf "| %-26s | %-8s | %10s | %11s | %10s | %10s | %10s | %11s | %10s | %11s |\n", label, unit,
        cell("cca", what), cell("cca-relaxed", what), cell("torch-native", what), cell("cca-expandable", what),
        cell("torch-expandable", what), cell("cudaMallocAsync", what), cell("cudaMalloc", what), ratio(what)
}
END {
    printf "| %-26s | %-8s | %10s | %11s | %10s | %10s | %10s | %11s | %10s | %11s |\n", "workload", "unit",
        "cca", "cca relaxed", "PyTorch", "cca expand", "PyT expand", "MallocAsync", "cudaMalloc", "cca/PyTorch"
    printf "|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n", "----------------------------", "----------",
        "------------", "-------------", "------------", "------------", "------------", "-------------", "------------", "-------------"
    row("pair latency 512 B", "pair_512", "ns/pair")
    row("pair 512 B, device named", "pair_latency_named_device", "ns/pair")
    row("cuCtxGetCurrent (cca asks)", "query_cuCtxGetCurrent", "ns")
    row("cudaGetDevice", "query_cudaGetDevice", "ns")
    row("pair latency 1 MiB", "pair_1048576", "ns/pair")
    row("pair latency 64 MiB", "pair_67108864", "ns/pair")
    row("random, 1 thread", "random_1thread", "ns/op")
    row("random: the draws alone", "random_generator_only", "ns/op")
    row("1 thread, 1 stream", "threads=1", "M ops/s")
    row("2 threads, 2 streams", "threads=2", "M ops/s")
    row("4 threads, 4 streams", "threads=4", "M ops/s")
    row("8 threads, 8 streams", "threads=8", "M ops/s")
    row("16 threads, 16 streams", "threads=16", "M ops/s")
    row("1 thread, after warm-up", "threads_warm=1", "M ops/s")
    row("16 threads, after warm-up", "threads_warm=16", "M ops/s")
    row("pinned host pair 512 B", "pinned_512", "ns/pair")
    row("pinned host pair 1 MiB", "pinned_1048576", "ns/pair")
}' "$logs/results.txt" >"$logs/table.md"

echo
echo "Steps:"
printf '  %s\n' "${step_lines[@]}" | tee "$logs/steps.txt"
echo
echo "cca vs. the anchors (ns: lower is better, M ops/s: higher is better;"
echo "cca/PyTorch = cca's figure over PyTorch native's):"
cat "$logs/table.md"
if [ -f "$logs/bench-cca-sim.log" ]; then
    echo
    echo "CPU: the simulated device's cached pair against glibc's (bench-cca-sim.log):"
    grep -E '^(# cpu pair ratio|RESULT (cca-sim|glibc) pair_latency(_best)? size=512 )' "$logs/bench-cca-sim.log"
fi
if [ -f "$logs/bench-floor.log" ]; then
    echo
    echo "CPU: the random workload below cca, PyTorch's placement alone (bench-floor.log):"
    grep '^#' "$logs/bench-floor.log"
fi
if [ -f "$logs/bench-replay.log" ]; then
    echo
    cat "$logs/bench-replay.log"
fi
echo
finish_run

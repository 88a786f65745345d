#!/bin/sh
# make install's products are usable: install the build this test belongs to
# into a temporary prefix (outside the system's paths), then build and run a
# small C program against it with pkg-config (shared: it finds the installed
# libcca.so without LD_LIBRARY_PATH; --static: it needs no libcca.so at all)
# and with CMake's find_package(cca); the installed cca runs without
# LD_LIBRARY_PATH.
set -u
cli=$1
build=$(cd "$(dirname "$cli")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL $*"; exit 1; }

cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail install; }
for f in include/cca.h include/cca_backend.h lib/libcca.a lib/libcca.so bin/cca \
         lib/pkgconfig/cca.pc lib/pkgconfig/cca-shared.pc lib/cmake/cca/ccaConfig.cmake; do
    [ -e "$tmp/prefix/$f" ] || fail "missing $f"
done
"$tmp/prefix/bin/cca" settings >/dev/null || fail "installed cca settings"
env -u LD_LIBRARY_PATH "$tmp/prefix/bin/cca" --help >/dev/null 2>&1 || fail "installed cca --help without LD_LIBRARY_PATH"
if command -v ldd >/dev/null 2>&1; then
    ldd "$tmp/prefix/bin/cca" | grep -q 'not found' && fail "installed cca misses a library: $(ldd "$tmp/prefix/bin/cca")"
    ldd "$tmp/prefix/lib/libcca.so" | grep -q 'not found' && fail "installed libcca.so misses a library"
fi

# the Python package, with the adapter source, finding the installed library
pkg=$(ls -d "$tmp"/prefix/lib/python3*/site-packages/cca 2>/dev/null | head -1)
[ -n "$pkg" ] && [ -f "$pkg/__init__.py" ] && [ -f "$pkg/torch_adapter.cpp" ] || fail "Python package not installed"
[ -f "$pkg/cupy.py" ] && [ -f "$pkg/numba.py" ] || fail "cca.cupy and cca.numba not installed"
if command -v python3 >/dev/null 2>&1; then
    got=$(cd "$tmp" && env -u CCA_LIBRARY PYTHONPATH="$(dirname "$pkg")" python3 -c \
        'import cca, cca._lib as l; print(cca.library_path()); print(l.include_dir())') || fail "import cca"
    echo "$got" | grep -q "^$tmp/prefix/lib/libcca.so" || fail "installed cca uses $got"
    echo "$got" | grep -q "^$tmp/prefix/include$" || fail "installed cca's header: $got"
    # Numba's NUMBA_CUDA_MEMORY_MANAGER=cca.numba entry point, with or without Numba here
    got=$(cd "$tmp" && env -u CCA_LIBRARY PYTHONPATH="$(dirname "$pkg")" python3 -c \
        'import cca.cupy, cca.numba; print(cca.numba._numba_memory_manager.__name__)') || fail "import cca.numba"
    [ "$got" = CCAMemoryManager ] || fail "installed cca.numba's entry point: $got"
fi

cat >"$tmp/app.c" <<'EOC'
#include <cca.h>
#include <cca_backend.h>
#include <stdio.h>
int main(void)
{
    cca_backend_t *sim;
    cca_sim_config_t cfg = {0};
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, "") != CCA_OK)
        return 1;
    void *p = NULL;
    if (cca_malloc(&p, 4096, NULL) != CCA_OK || !p || cca_free(p) != CCA_OK)
        return 2;
    cca_shutdown();
    puts("app ok");
    return 0;
}
EOC
# a sanitized build's library needs the sanitizer runtimes in the program too
san=""
if nm "$tmp/prefix/lib/libcca.a" 2>/dev/null | grep -q __asan_; then san="-fsanitize=address,undefined"; fi
if nm "$tmp/prefix/lib/libcca.a" 2>/dev/null | grep -q __tsan_; then san="-fsanitize=thread"; fi

if ! command -v pkg-config >/dev/null 2>&1; then
    echo "note: pkg-config is not installed; checking the .pc file by hand"
    grep -q '^Requires: cca-shared' "$tmp/prefix/lib/pkgconfig/cca.pc" || fail "cca.pc content"
    grep -q '^Libs: -L${libdir} .*-lcca' "$tmp/prefix/lib/pkgconfig/cca-shared.pc" || fail "cca-shared.pc content"
    flags="-I$tmp/prefix/include -L$tmp/prefix/lib -lcca"
else
PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --exists cca || fail "pkg-config does not find cca"
flags=$(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --cflags --libs cca)
static_flags=$(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --static --cflags --libs cca)
fi
# shellcheck disable=SC2086
cc $san "$tmp/app.c" -o "$tmp/app_pc" $flags \
    >"$tmp/cc.log" 2>&1 || { cat "$tmp/cc.log"; fail "pkg-config build"; }
if [ -n "${static_flags:-}" ]; then
    # the program finds the installed library by itself (cca-shared.pc's RPATH)
    env -u LD_LIBRARY_PATH "$tmp/app_pc" | grep -q "app ok" || fail "pkg-config program without LD_LIBRARY_PATH"
    needed() { LC_ALL=C readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
    needed "$tmp/app_pc" | grep -q '^libcca\.so' || fail "pkg-config --libs does not link libcca.so"
    # shellcheck disable=SC2086
    cc $san "$tmp/app.c" -o "$tmp/app_static" $static_flags \
        >"$tmp/cc.log" 2>&1 || { cat "$tmp/cc.log"; fail "pkg-config --static build"; }
    needed "$tmp/app_static" | grep -q '^libcca\.so' && fail "pkg-config --static links libcca.so: $static_flags"
    env -u LD_LIBRARY_PATH "$tmp/app_static" | grep -q "app ok" || fail "pkg-config --static program"
else
    LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/app_pc" | grep -q "app ok" || fail "pkg-config program"
fi

mkdir -p "$tmp/proj"
cat >"$tmp/proj/CMakeLists.txt" <<'EOC'
cmake_minimum_required(VERSION 3.20)
project(app C)
find_package(cca REQUIRED)
add_executable(app ../app.c)
target_link_libraries(app PRIVATE cca::cca_static)
EOC
cmake -S "$tmp/proj" -B "$tmp/proj/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
    -DCMAKE_C_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" >"$tmp/cmake.log" 2>&1 \
    || { cat "$tmp/cmake.log"; fail "find_package(cca)"; }
cmake --build "$tmp/proj/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "CMake build"; }
"$tmp/proj/build/app" | grep -q "app ok" || fail "CMake program"
echo "ok   install, pkg-config (shared and --static) and find_package, no LD_LIBRARY_PATH"
echo "1 passed, 0 failed"

#!/bin/sh
# Arrows only point down (STYLE.md, docs/architecture.md): no file of a lower
# folder of src/ includes a header of a higher one. Every #include "x.h" of
# src/ is resolved to the folder holding x.h (the include path is flat, so a
# header's name is unique across src/) and compared by rank; a header in
# include/ (the public API) may be included anywhere. Fails naming each
# include that points up, each unknown folder and each ambiguous header name.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root/src" || exit 1

# The layers, bottom first; folders on one line are one layer and may
# include each other's headers.
layers='core
backend backend/sim backend/cuda
formats
observe
device_async
device
host ipc
runtime
replay
bindings'

rank_of() { # folder -> its layer's rank, or nothing
    echo "$layers" | awk -v d="$1" '{ for (i = 1; i <= NF; i++) if ($i == d) print NR }'
}

fail=0
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
find . -name '*.[ch]' -o -name '*.cpp' | sed 's|^\./||' | sort >"$tmp"
checked=0
while read -r file; do
    dir=$(dirname "$file")
    from=$(rank_of "$dir")
    if [ -z "$from" ]; then
        echo "FAIL $file: folder $dir is in no layer (add it to tests/unit/test_layers.sh and docs/architecture.md)"
        fail=1
        continue
    fi
    for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$file"); do
        [ -f "$root/include/$inc" ] && continue
        where=$(grep -x "\(.*/\)\{0,1\}$inc" "$tmp" | grep "/$inc\$\|^$inc\$")
        n=$(printf '%s\n' "$where" | grep -c .)
        if [ "$n" -eq 0 ]; then
            [ -f "$root/src/$dir/$inc" ] && continue
            echo "FAIL $file includes \"$inc\", found nowhere in src/ or include/"
            fail=1
            continue
        fi
        if [ "$n" -gt 1 ]; then
            echo "FAIL $file includes \"$inc\", a name several folders hold: $(echo $where)"
            fail=1
            continue
        fi
        to=$(rank_of "$(dirname "$where")")
        checked=$((checked + 1))
        if [ -n "$to" ] && [ "$to" -gt "$from" ]; then
            echo "FAIL $file ($dir) includes $where: an arrow up"
            fail=1
        fi
    done
done <"$tmp"
if [ "$fail" -ne 0 ]; then
    echo "0 passed, 1 failed"
    exit 1
fi
echo "ok   $checked includes in src/, none points up"
echo "1 passed, 0 failed"

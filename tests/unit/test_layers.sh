#!/bin/sh
# Arrows only point down (docs/architecture.md): no file of a lower folder of
# src/ includes a header of, or calls a function of, a higher one.
# Includes: every #include "x.h" of src/ is resolved to the folder holding x.h
# (the include path is flat, so a header's name is unique across src/) and
# compared by rank; a header in include/ (the public API) may be included
# anywhere. Calls: given the cca CLI of a build ($1), every symbol an object of
# the library takes from another must be defined in its own layer or below (a
# public cca_ function defined higher up counts). Fails naming each include
# or call that points up, each unknown folder and each ambiguous header name.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
objdir=""
[ $# -ge 1 ] && objdir="$(cd "$(dirname "$1")" && pwd)/CMakeFiles/cca_objects.dir/src"
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

# Calls, through the library's objects (those whose source still exists)
calls=0
if [ -n "$objdir" ] && [ -d "$objdir" ] && command -v nm >/dev/null 2>&1; then
    syms=$(mktemp)
    trap 'rm -f "$tmp" "$syms"' EXIT
    for o in $(cd "$objdir" && find . -name '*.c.o' | sed 's|^\./||' | sort); do
        src=${o%.o}
        [ -f "$root/src/$src" ] || continue
        r=$(rank_of "$(dirname "$src")")
        [ -n "$r" ] || continue
        nm -P "$objdir/$o" | awk -v r="$r" -v f="$src" '
            $2 == "U" { print "U", $1, r, f; next }
            $2 ~ /^[TDBRVW]$/ { print "D", $1, r, f }' >>"$syms"
    done
    up=$(awk 'NR == FNR { if ($1 == "D") { rank[$2] = $3; file[$2] = $4 } next }
              $1 == "U" && ($2 in rank) { n++; if (rank[$2] > $3) print "FAIL " $4 " calls " $2 ", defined in " file[$2] ": an arrow up" }
              END { print "calls", n + 0 }' "$syms" "$syms")
    calls=$(echo "$up" | sed -n 's/^calls //p')
    if echo "$up" | grep -q '^FAIL'; then
        echo "$up" | grep '^FAIL'
        fail=1
    fi
else
    echo "note: no objects of a build at hand (pass the cca CLI of one): calls not checked"
fi
if [ "$fail" -ne 0 ]; then
    echo "0 passed, 1 failed"
    exit 1
fi
echo "ok   $checked includes in src/ and $calls calls between its files, none points up"
echo "1 passed, 0 failed"

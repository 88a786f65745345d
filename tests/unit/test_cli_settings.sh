#!/bin/sh
# test_cli_settings.sh - `cca settings`: output lines, sources, exit codes.
# Usage: sh tests/unit/test_cli_settings.sh path/to/cca
set -u
CCA=${1:?usage: test_cli_settings.sh path/to/cca}
passed=0
failed=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM

fail() {
    echo "FAIL $name: $*"
    failed=$((failed + 1))
}

ok() {
    echo "ok   $name"
    passed=$((passed + 1))
}

# run NAME EXPECTED_RC [ARGS...]: runs cca settings into $tmp/out and $tmp/err
run() {
    name=$1; want=$2; shift 2
    "$CCA" settings "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
    if [ "$rc" -ne "$want" ]; then
        fail "exit status $rc, expected $want"; cat "$tmp/err"; return 1
    fi
    return 0
}

has_line() { # file, exact line
    grep -qxF "$2" "$1"
}

unset CCA_ALLOC_CONF

name=defaults
if run defaults 0; then
    lines=$(wc -l <"$tmp/out")
    if [ "$lines" -ne 18 ]; then fail "expected 18 lines, got $lines"
    elif ! has_line "$tmp/out" "max_split_size_mb unlimited (default)"; then fail "max_split_size_mb line"
    elif ! has_line "$tmp/out" "backend native (default)"; then fail "backend line"
    elif ! has_line "$tmp/out" "expandable_segments False (default)"; then fail "expandable_segments line"
    elif [ "$(grep -c ' (default)$' "$tmp/out")" -ne 18 ]; then fail "not every key is a default"
    elif [ -s "$tmp/err" ]; then fail "unexpected stderr"
    elif [ "$(head -n 1 "$tmp/out" | cut -d' ' -f1)" != backend ]; then fail "first line is not backend"
    elif [ "$(tail -n 1 "$tmp/out" | cut -d' ' -f1)" != compact_memory ]; then fail "last line"
    else ok; fi
fi

name=argument
if run argument 0 'max_split_size_mb:256, roundup_power2_divisions:[256:1,512:2,1024:4,>:8], garbage_collection_threshold:0.8'; then
    if ! has_line "$tmp/out" "max_split_size_mb 256 (argument)"; then fail "max_split_size_mb"
    elif ! has_line "$tmp/out" "roundup_power2_divisions [256:1,512:2,1024:4,>:8] (argument)"; then fail "roundup"
    elif ! has_line "$tmp/out" "garbage_collection_threshold 0.8 (argument)"; then fail "gc threshold"
    elif ! has_line "$tmp/out" "large_segment_size_mb 20 (default)"; then fail "large_segment_size_mb"
    else ok; fi
fi

name=environment_then_argument
export CCA_ALLOC_CONF='expandable_segments:True,max_split_size_mb:128'
if run environment_then_argument 0 'max_split_size_mb:512'; then
    if ! has_line "$tmp/out" "expandable_segments True (environment)"; then fail "environment source"
    elif ! has_line "$tmp/out" "max_split_size_mb 512 (argument)"; then fail "argument overrides environment"
    else ok; fi
fi

name=environment_only
if run environment_only 0; then
    if ! has_line "$tmp/out" "max_split_size_mb 128 (environment)"; then fail "environment value"
    else ok; fi
fi

name=bad_environment
export CCA_ALLOC_CONF='expandable_segments:maybe'
if run bad_environment 1; then
    if [ -s "$tmp/out" ]; then fail "stdout not empty"
    elif ! grep -qF "CCA_ALLOC_CONF" "$tmp/err"; then fail "message does not name CCA_ALLOC_CONF"
    elif ! grep -qF "'expandable_segments:maybe'" "$tmp/err"; then fail "message does not name key:value"
    else ok; fi
fi
unset CCA_ALLOC_CONF

name=bad_value
if run bad_value 1 'max_split_size_mb:10'; then
    if [ -s "$tmp/out" ]; then fail "stdout not empty"
    elif ! grep -qF "max_split_size_mb too small, must be >= 20" "$tmp/err"; then fail "message"
    elif ! grep -qF "'max_split_size_mb:10'" "$tmp/err"; then fail "key:value in message"
    else ok; fi
fi

name=unknown_key
if run unknown_key 1 'foo:1'; then
    if ! grep -qF "Unrecognized key 'foo' in allocator settings" "$tmp/err"; then fail "message"
    elif ! grep -qF "expandable_segments" "$tmp/err"; then fail "valid keys not listed"
    else ok; fi
fi

name=malformed
if run malformed 1 'max_split_size_mb'; then
    if ! grep -qF "Missing ':'" "$tmp/err"; then fail "message"; else ok; fi
fi

name=empty_string
if run empty_string 0 ''; then
    if [ "$(grep -c ' (default)$' "$tmp/out")" -ne 18 ]; then fail "not all defaults"; else ok; fi
fi

name=too_many_arguments
if run too_many_arguments 2 'backend:native' 'extra'; then
    if ! grep -qF "usage" "$tmp/err"; then fail "no usage on stderr"; else ok; fi
fi

name=help
if run help 0 --help; then
    if ! grep -qF "usage: cca settings" "$tmp/out"; then fail "no usage on stdout"; else ok; fi
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]

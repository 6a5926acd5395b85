#!/bin/sh
# desugar-optional.sh IN OUT - rewrite proto3 `optional T name = N;` into the
# equivalent synthetic oneof `oneof _name { T name = N; }` for protoc-c 1.4,
# which predates proto3 optional. Same wire format and field numbers; the
# public .proto files keep `optional` for every other generator.
set -eu
sed -E 's/^([[:space:]]*)optional[[:space:]]+([A-Za-z0-9_.]+)[[:space:]]+([A-Za-z0-9_]+)[[:space:]]*=[[:space:]]*([0-9]+)[[:space:]]*;/\1oneof _\3 { \2 \3 = \4; }/' "$1" > "$2"
if grep -Eq '^[[:space:]]*optional[[:space:]]' "$2"; then
    echo "desugar-optional.sh: $1: an 'optional' field was not rewritten (keep it on one line)" >&2
    exit 1
fi

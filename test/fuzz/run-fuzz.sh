#!/bin/sh
# run-fuzz.sh FUZZER CORPUS_DIR SECONDS - bounded libFuzzer run (docs/RELIABILITY.md C2).
# New inputs go to a scratch copy of the corpus, never into the source tree.
# $FUZZ_SECONDS, when set, replaces SECONDS (CI's shorter runs, longer ones by hand).
# Prints libFuzzer's final stats line (execs, cov); exit status is libFuzzer's.
set -eu
fuzzer=$1 corpus=$2 secs=${FUZZ_SECONDS:-${3:-30}}
[ -x "$fuzzer" ] || { echo "fuzzer $fuzzer not built (configure with CC=clang -Dfuzz=true)"; exit 77; }
work=$(mktemp -d "${TMPDIR:-/tmp}/stepd-fuzz-XXXXXX")
artifacts="${TMPDIR:-/tmp}/stepd-fuzz-artifacts"
mkdir -p "$artifacts"
trap 'rm -rf "$work"' EXIT
cp -r "$corpus"/. "$work"/
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  "$fuzzer" -max_total_time="$secs" -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=1 \
  -max_len=65536 -print_final_stats=1 -artifact_prefix="$artifacts/" "$work" 2>"$work.log" || { rc=$?; tail -50 "$work.log"; rm -f "$work.log"; echo "crash inputs: $artifacts"; exit 1; }
grep -E '^#[0-9]+.*(DONE|cov:)' "$work.log" | tail -1
grep -E 'stat::number_of_executed_units|stat::peak_rss_mb' "$work.log" || true
rm -f "$work.log"

#!/usr/bin/env bash
# The main job, end to end on one machine: install what is needed, build, then
# `stepd serve models/tiny-step --tensor-parallel-size $WORLD` (default 2: the coordinator
# starts and supervises a CPU worker group, UCX between the ranks, MTP speculation K=3), wait for readiness, stream
# a reply and a chat answer over gRPC with stepctl, then shut down cleanly (SIGTERM: drain,
# the ranks stop, exit 0).  Ports are picked free at start; the log goes to $LOGDIR.
# Nothing inside is open, even on one host: `stepd serve` makes a cluster key per run (a 0600
# file only its ranks read), the control port refuses workers without it and rank 0's engine
# refuses callers without it; UCX between the ranks binds loopback only.
set -euo pipefail
cd "$(dirname "$0")/../.."

WORLD=${WORLD:-2}
MODEL=${MODEL:-models/tiny-step}
PROMPT=${PROMPT:-"And God said, Let there be light"}
BUILD=${BUILD:-build}

# one line per phase, with its time; on a terminal ninja shows its own [k/N] progress
T0=$SECONDS
phase() { echo "== [$1/6] $2"; T0=$SECONDS; }
took() { echo "   done in $((SECONDS - T0)) s"; }
phase 1 "dependencies: Debian packages (apt-get) and the Python venv (pip): minutes on a first run"
bash tools/dev/install-deps.sh
took
if [ -f "$BUILD/build.ninja" ]; then
  phase 2 "configure: $BUILD is configured already"
else
  phase 2 "configure: meson setup $BUILD"
  meson setup "$BUILD" >/dev/null
  took
fi
todo=$(ninja -C "$BUILD" -n 2>/dev/null | grep -c '^\[' || true)
phase 3 "build: ninja -C $BUILD ($todo steps to run)"
if [ -t 1 ]; then ninja -C "$BUILD"; else ninja -C "$BUILD" >/dev/null; fi
took

LOGDIR=$(mktemp -d /tmp/stepd-demo.XXXXXX)
# five distinct free ports: all bound at once (ports picked one at a time, each socket closed
# before the next pick, may be the same port twice)
read -r PUB CTL ADM MET HTTP < <(/usr/bin/python3 -c 'import socket
ss = [socket.socket() for _ in range(5)]
for s in ss:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in ss])')

STEPD=
cleanup() {
  if [ -n "$STEPD" ] && kill -0 "$STEPD" 2>/dev/null; then kill "$STEPD"; wait "$STEPD" || true; fi
}
trap cleanup EXIT

phase 4 "serve: stepd serve $MODEL --tensor-parallel-size $WORLD (public 127.0.0.1:$PUB, log $LOGDIR/stepd.log)"
"$BUILD/daemon/stepd" serve "$MODEL" --tensor-parallel-size "$WORLD" --threads 1 \
  --speculative-config '{"method":"mtp","num_speculative_tokens":3}' --spec-log-interval 2 \
  --listen "127.0.0.1:$PUB" --control-listen "127.0.0.1:$CTL" \
  --admin-listen "127.0.0.1:$ADM" --metrics-listen "127.0.0.1:$MET" --port "$HTTP" 2>"$LOGDIR/stepd.log" &
STEPD=$!

CTLARGS=(--addr "127.0.0.1:$PUB" --admin-addr "127.0.0.1:$ADM")
phase 5 "wait for readiness: the ranks load the model and form their group (stepctl wait-ready)"
"$BUILD/tools/stepctl" "${CTLARGS[@]}" wait-ready --timeout 180
took
phase 6 "requests"
echo "== generate: \"$PROMPT\""
"$BUILD/tools/stepctl" "${CTLARGS[@]}" generate --max-tokens 48 "$PROMPT"
echo
echo "== chat"
"$BUILD/tools/stepctl" "${CTLARGS[@]}" chat --max-tokens 48 "Who made the heaven and the earth?"
echo
echo
echo "== the same chat over the OpenAI HTTP API (curl, 127.0.0.1:$HTTP; the tiny model's answer is"
echo "   all reasoning: the template opens <think> and the model never closes it, README.md)"
curl -sS "http://127.0.0.1:$HTTP/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "tiny-step", "max_tokens": 48, "messages": [{"role": "user", "content": "Who made the heaven and the earth?"}]}' |
  /usr/bin/python3 -c 'import json, sys
r = json.load(sys.stdin)
if "choices" not in r:
    sys.exit("no answer: %s" % json.dumps(r))
m = r["choices"][0]["message"]
print("reasoning_content: %s" % m["reasoning_content"])
print("content: %s" % json.dumps(m["content"]))
print("finish_reason: %s, usage: %s" % (r["choices"][0]["finish_reason"], json.dumps(r["usage"])))'
echo "== groups"
"$BUILD/tools/stepctl" "${CTLARGS[@]}" groups
sleep 2.5   # one spec-decoding metrics interval
echo "== from the log"
grep -E "MTP|load plan|control key in|startup complete|spec decode metrics" "$LOGDIR/stepd.log" | sed 's/^<[0-9]>//'
echo "== stopping (SIGTERM: drain, then the ranks stop)"
kill -TERM "$STEPD"
rc=0; wait "$STEPD" || rc=$?
STEPD=
echo "== stepd exited $rc; log in $LOGDIR"
exit "$rc"

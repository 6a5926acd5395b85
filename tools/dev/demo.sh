#!/usr/bin/env bash
# The main job, end to end on one machine: install what is needed, build, start the
# coordinator and a CPU worker group (world size $WORLD, default 2, UCX between ranks) on the
# bundled tiny model, wait for readiness, stream a reply over gRPC with stepctl, then shut
# everything down cleanly (drain).  Ports are picked free at start; logs go to $LOGDIR.
set -euo pipefail
cd "$(dirname "$0")/../.."

WORLD=${WORLD:-2}
MODEL=${MODEL:-models/tiny-step}
PROMPT=${PROMPT:-"And God said, Let there be light"}
BUILD=${BUILD:-build}

bash tools/dev/install-deps.sh
[ -f "$BUILD/build.ninja" ] || meson setup "$BUILD" >/dev/null
ninja -C "$BUILD" >/dev/null

LOGDIR=$(mktemp -d /tmp/stepd-demo.XXXXXX)
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PUB=$(free_port); CTL=$(free_port); ADM=$(free_port); MET=$(free_port)
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

echo "== starting stepd (public 127.0.0.1:$PUB, logs in $LOGDIR)"
"$BUILD/daemon/stepd" --listen "127.0.0.1:$PUB" --control-listen "127.0.0.1:$CTL" \
  --admin-listen "127.0.0.1:$ADM" --metrics-listen "127.0.0.1:$MET" \
  --tokenizer "$MODEL/tokenizer.json" 2>"$LOGDIR/stepd.log" &
STEPD=$!
pids+=("$STEPD")

echo "== starting a CPU worker group of $WORLD rank(s) on $MODEL"
for ((r = 0; r < WORLD; r++)); do
  "$BUILD/worker/stepd-worker" --coordinator "127.0.0.1:$CTL" --group g0 --rank "$r" \
    --world-size "$WORLD" --device cpu --model "$MODEL" --threads 1 2>"$LOGDIR/worker-$r.log" &
  pids+=("$!")
done

CTLARGS=(--addr "127.0.0.1:$PUB" --admin-addr "127.0.0.1:$ADM")
"$BUILD/tools/stepctl" "${CTLARGS[@]}" wait-ready --timeout 180
echo "== generate: \"$PROMPT\""
"$BUILD/tools/stepctl" "${CTLARGS[@]}" generate --max-tokens 48 "$PROMPT"
echo
echo "== chat"
"$BUILD/tools/stepctl" "${CTLARGS[@]}" chat --max-tokens 48 "Who made the heaven and the earth?"
echo
echo "== draining"
"$BUILD/tools/stepctl" "${CTLARGS[@]}" drain
wait "$STEPD"
echo "== stepd exited $?; logs in $LOGDIR"

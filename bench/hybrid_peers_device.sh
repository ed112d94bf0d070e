#!/usr/bin/env bash
# Issue 21 on the GPU machine: bench.peers_decode for the Qwen3.5 shapes, in calls that each end inside
# the device's 10-minute limit (bench/peers_decode.py's docstring says why the steps are split so).
# From the repo root, one device call each, chained closely:
#
#   bash bench/hybrid_peers_device.sh start-35b   # first: onnxgen's 35B-A3B int4 package, built in the
#                                                 # background (needs no onnxruntime-genai)
#   then the onnxruntime-gpu / onnxruntime-genai-cuda set-up calls (.wcK/stash.sh, same docstring)
#   bash bench/hybrid_peers_device.sh 0.8b fp16   # the 0.8B table (checkpoint, both builders' packages, engines)
#   bash bench/hybrid_peers_device.sh 0.8b int4
#   bash bench/hybrid_peers_device.sh 35b         # waits for the background build (at most WAIT_S, 300), then the table
#
# The background build runs in its own session (setsid), so it outlives the call that started it
# while the machine stays warm (30 s after each call); it keeps one CPU core busy while the 0.8B
# tables are timed (say so beside their numbers). Tables land in $OUT.
# Optional llama.cpp row for the 0.8B shape: LLAMACPP=/tmp/lc TOKENIZER_FROM=<dir with a Qwen2.5
# tokenizer.json> (bench/llamacpp_peer.py says how to build the tree and where a tokenizer comes from).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
w08=/tmp/peers-qwen3.5-0.8b
w35=/tmp/peers-qwen3.5-35b-a3b
engines08=onnxgen,onnxgen-eager,ort-genai-graph,ort-genai,ort-genai-own-graph,ort-genai-own,onnxgen-on-genai,hf-eager
# no checkpoint fits the disk for 35B-A3B, so only the engines on onnxgen's package (peers_decode --plan)
engines35=onnxgen,onnxgen-eager,ort-genai-graph,ort-genai
run35=(python3 -m bench.peers_decode --shape qwen3.5-35b-a3b --precision int4 --workdir "$w35" --memory-gb 120)

site() {  # onnxruntime-gpu 1.31.1 and onnxruntime-genai-cuda 0.18, installed by the set-up calls
  # shellcheck disable=SC1091
  source /tmp/site-env.sh || { echo "no /tmp/site-env.sh: run the .wcK/stash.sh set-up calls first"; exit 2; }
}

case "${1:-}" in
  start-35b)
    mkdir -p "$w35"
    # the package does not depend on the engines; onnxgen alone needs no onnxruntime-genai yet
    "${run35[@]}" --engines onnxgen --plan || exit 2
    setsid bash -c 'echo $$ > "$0/build.pid"; exec "${@}"' "$w35" "${run35[@]}" --engines onnxgen --build-only \
      > "$w35/build.log" 2>&1 < /dev/null &
    sleep 15
    tail -n 3 "$w35/build.log"
    ;;
  0.8b)
    precision=${2:?fp16 or int4}
    site
    extra=()
    if [ -n "${LLAMACPP:-}" ]; then
      extra=(--llamacpp "$LLAMACPP" --tokenizer-from "$TOKENIZER_FROM")
      engines08+=,llama-cpp
    fi
    python3 -m bench.peers_decode --shape qwen3.5-0.8b --precision "$precision" --engines "$engines08" \
      --workdir "$w08" "${extra[@]}" | tee "$out/peers-qwen3.5-0.8b-$precision.md"
    ;;
  35b)
    waited=0
    while kill -0 "$(cat "$w35/build.pid" 2>/dev/null)" 2>/dev/null; do
      if [ "$waited" -ge "${WAIT_S:-300}" ]; then
        tail -n 3 "$w35/build.log"
        echo "the 35B-A3B package is still being built: call again"
        exit 3
      fi
      sleep 10
      waited=$((waited + 10))
    done
    if ! grep -q "^$w35/pkg-" "$w35/build.log"; then
      tail -n 20 "$w35/build.log"
      echo "the background build did not finish (its log above); start-35b again"
      exit 4
    fi
    cp "$w35/build.log" "$out/peers-qwen3.5-35b-a3b-build.log"
    site
    "${run35[@]}" --engines "$engines35" | tee "$out/peers-qwen3.5-35b-a3b-int4.md"
    ;;
  *)
    echo "usage: $0 start-35b | 0.8b fp16|int4 | 35b"
    exit 2
    ;;
esac

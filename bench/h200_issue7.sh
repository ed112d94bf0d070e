#!/usr/bin/env bash
# One device call's worth of issue 7 measurements on the lent H200 (see bench/README.md for the set-up
# calls that carry the peer wheels and the SmolLM2 GGUF first). Run from the repo root:
#     bash bench/h200_issue7.sh [STAGE ...]   # logs to $OUT (the device tool's output folder) or ./h200-logs
# All stages take ~16 minutes, more than one call's 10: run them in two calls, e.g.
#     bash bench/h200_issue7.sh peers_fp16 peers_int4 gemv_default gemv_optin
#     bash bench/h200_issue7.sh qwen_1024 qwen15_fp16 profile standard proof
# Each stage has its own time limit, so one slow stage cannot eat the call; the tail of every log is
# printed. Stages: peers (0.5B fp16 and int4), onnxgen alone (1.5B, 1,024 tokens), the opt-in int4
# GEMV against the default, a decode-only profile, and the SmolLM2 real-weight capture proof.
set -u
out=${OUT:-$PWD/h200-logs}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD
[ -f /tmp/site-env.sh ] && source /tmp/site-env.sh
wanted=" $* "
stage() {
  local name=$1 limit=$2
  shift 2
  [ "$wanted" = "  " ] || [[ "$wanted" == *" $name "* ]] || return 0
  echo "### $name ($(date +%T)): $*"
  (cd bench && timeout "$limit" "$@") >"$out/$name.log" 2>&1
  echo "### $name rc=$?"
  grep -v '^\s*$' "$out/$name.log" | tail -n 14
}
Q="--shape qwen2.5-coder-0.5b-instruct"
stage peers_fp16 170 python3 peers_decode.py $Q --precision fp16 --workdir /tmp/peers
stage peers_int4 150 python3 peers_decode.py $Q --precision int4 --workdir /tmp/peers
stage gemv_default 60 python3 capture_decode.py $Q --precision int4 --context 512 --capture-only
stage gemv_optin 60 env ONNXGEN_TRITON_GEMV=1 python3 capture_decode.py $Q --precision int4 --context 512 --capture-only
stage qwen_1024 60 python3 capture_decode.py $Q --precision fp16 --context 2048 --new-tokens 1024 --repeats 1 --capture-only
stage qwen15_fp16 90 python3 capture_decode.py --shape qwen2.5-coder-1.5b-instruct --precision fp16 --context 512 --capture-only
stage profile 60 python3 profile_decode.py $Q --precision fp16 --context 512 --capture --steps 16 --top 15
stage standard 80 python3 capture_decode.py $Q --precision fp16 --attention standard --kv dynamic --repeats 2
stage proof 240 python3 -m pytest -q -p no:cacheprovider -m gpu ../tests/test_gpu_capture_models.py ../tests/test_capture_runtime.py -s
echo "logs in $out"

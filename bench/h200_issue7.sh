#!/usr/bin/env bash
# One device call's worth of issue 7 measurements on the lent H200 (see bench/README.md for the set-up
# calls that carry the peer wheels and the SmolLM2 GGUF first). Run from the repo root:
#     bash bench/h200_issue7.sh [STAGE ...]   # logs to $OUT (the device tool's output folder) or ./h200-logs
# All stages take far more than one call's 10 minutes: name the stages of each call, e.g.
#     bash bench/h200_issue7.sh micro fp16 fp16_cublas int4 int4_cublas profile
#     bash bench/h200_issue7.sh peers_fp16 peers_int4 gpu_tests
# Each stage has its own time limit, so one slow stage cannot eat the call; the tail of every log is
# printed. Stages: the GEMV micro bench, the 0.5B step with triton_linear's GEMVs vs cuBLAS (fp16,
# int4), the pipelined vs the sequential decode loop, a decode-only profile, 1,024 tokens, the 1.5B
# shape, the standard flavour, the peers, the GPU parity tests and the capture proofs.
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
C="python3 capture_decode.py"
# GEMV kernels alone (triton_linear vs cuBLAS vs the earlier int4 GEMV), then the whole step
T="env ONNXGEN_TRITON_LINEAR=1"
stage micro 150 python3 gemv_micro.py --quick
stage micro_down 70 python3 gemv_micro.py --layers down
stage gpu_fixes 100 python3 -m pytest -q -p no:cacheprovider -m gpu ../tests/test_fusion.py ../tests/test_pipelined_decode.py ../tests/test_capture_runtime.py -k "masked or pipelined or syncing"
stage fp16 60 $C $Q --precision fp16 --context 512 --capture-only
stage fp16_triton 60 $T $C $Q --precision fp16 --context 512 --capture-only
stage int4 60 $C $Q --precision int4 --context 512 --capture-only
stage int4_triton 60 $T $C $Q --precision int4 --context 512 --capture-only
stage fp16_sequential 60 $C $Q --precision fp16 --context 512 --capture-only --no-pipeline
stage profile 60 python3 profile_decode.py $Q --precision fp16 --context 512 --capture --steps 16 --top 15
stage qwen_1024 60 $C $Q --precision fp16 --context 2048 --new-tokens 1024 --repeats 1 --capture-only
stage qwen15_fp16 90 $C --shape qwen2.5-coder-1.5b-instruct --precision fp16 --context 512 --capture-only
stage qwen15_int4 90 $C --shape qwen2.5-coder-1.5b-instruct --precision int4 --context 512 --capture-only
stage standard 80 $C $Q --precision fp16 --attention standard --kv dynamic --repeats 2
stage peers_fp16 170 python3 peers_decode.py $Q --precision fp16 --workdir /tmp/peers
stage peers_int4 150 python3 peers_decode.py $Q --precision int4 --workdir /tmp/peers
stage peers_fp16_triton 80 $T python3 peers_decode.py $Q --precision fp16 --workdir /tmp/peers --engines onnxgen
stage peers15_fp16 250 python3 peers_decode.py --shape qwen2.5-coder-1.5b-instruct --precision fp16 --workdir /tmp/peers15
stage gpu_tests 200 $T python3 -m pytest -q -p no:cacheprovider -m gpu ../tests/test_fusion.py ../tests/test_model_parity.py ../tests/test_kernels_contrib.py
stage proof 240 python3 -m pytest -q -p no:cacheprovider -m gpu ../tests/test_gpu_capture_models.py ../tests/test_capture_runtime.py -s
echo "logs in $out"

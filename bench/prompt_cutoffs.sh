#!/usr/bin/env bash
# TTFT with the prompt-length cutoffs of two prompt kernels at the tree's values and at 64 each:
# gpu/gated_delta_decode.MAX_SEQUENTIAL_TOKENS (the sequential Gated DeltaNet kernel; past it the torch
# path's chunked form) and gpu/linear_q4.AUTO_SPLIT_ROWS / SPLIT_MAX_ROWS (the split-K 4-bit GEMM; past
# it dequantize-then-cuBLAS). They are module constants, so the 64 side runs from a copy of the tree in
# its own process: python -m bench.prefill at 64, 100 and 128 tokens on the 1.5B int4 shape, the
# qwen3.5-0.8b fp16 and int4 shapes (random weights) and, where bench/hybrid_peers_device.sh build-35b
# made it, the 35B-A3B int4 package. CUDA only. Run from the repo root:
#
#     bash bench/prompt_cutoffs.sh
set -u
export PYTHONUNBUFFERED=1
here=$PWD
low=$(mktemp -d)
cp -r onnxgen bench pyproject.toml "$low/"
sed -i 's/^SPLIT_MAX_ROWS = [0-9]*/SPLIT_MAX_ROWS = 64/; s/^AUTO_SPLIT_ROWS = [0-9]*/AUTO_SPLIT_ROWS = 64/' \
  "$low/onnxgen/runtime/gpu/linear_q4.py"
sed -i 's/^MAX_SEQUENTIAL_TOKENS = [0-9]*/MAX_SEQUENTIAL_TOKENS = 64/' "$low/onnxgen/runtime/gpu/gated_delta_decode.py"
echo "cutoffs: tree $(grep -h '^AUTO_SPLIT_ROWS\|^MAX_SEQUENTIAL_TOKENS' onnxgen/runtime/gpu/*.py | tr '\n' ' ')"
echo "cutoffs: copy $(grep -h '^AUTO_SPLIT_ROWS\|^MAX_SEQUENTIAL_TOKENS' "$low"/onnxgen/runtime/gpu/*.py | tr '\n' ' ')"
prefill() {  # DIR ARGS...: bench.prefill from that tree, its TTFT lines
  (cd "$1" && PYTHONPATH=$1 timeout 200 python3 -m bench.prefill "${@:2}" --context 2048 --lengths 64,100,128 \
    --repeats 5 2>&1 | grep "prompt ")
}
shapes=("--shape qwen2.5-coder-1.5b-instruct --precision int4" "--shape qwen3.5-0.8b --precision fp16"
  "--shape qwen3.5-0.8b --precision int4")
p35=$(compgen -G "/tmp/peers-qwen3.5-35b-a3b/pkg-qwen3.5-35b-a3b-int4-cuda-gqa-seed*[0-9]" | head -1)
[ -n "$p35" ] && shapes+=("--package $p35")
for s in "${shapes[@]}"; do
  for side in tree 64; do
    dir=$here; [ "$side" = 64 ] && dir=$low
    echo "# $s: cutoffs of the $side"
    # shellcheck disable=SC2086
    prefill "$dir" $s
  done
done
rm -rf "$low"

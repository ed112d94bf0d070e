#!/usr/bin/env bash
# TTFT of the qwen3.5-0.8b fp16 prompt under the Gated DeltaNet prompt paths: the sequential kernel with the
# q / k norms and the gate folded in (ONNXGEN_GDN_CHUNKED_FROM=0: every prompt up to 128 tokens) or run first
# as their own kernels (and ONNXGEN_GDN_PROMPT_FOLD=0: about half the kernel's instructions per token step),
# and the chunked kernels (gpu/gated_delta_chunked.py; the default from 17 tokens since 2026-12-06, with no
# upper bound since that night) under several of their module constants: the chunk length
# (CHUNK 16, 32 = the tree's, 64), the products' precision (IEEE fp32 on the FMA units, the tree's; or
# tf32x3, three TF32 tensor-core products per fp32 product) and the state kernel's value columns per program
# (STATE_COLUMNS 16 = the tree's, 32). The tree's form beat the sequential kernel from 17 tokens on the H200
# (docs/benchmarks/2026-12-06-h200-gdn-chunked.md), and past 128 tokens the torch path's chunked form
# (2026-12-06-h100-memory-and-chunked.md); the other forms are not timed yet. Each variant runs from a copy
# of the tree in its own process (module constants), with ONNXGEN_GDN_CHUNKED_TO=0 (the chunked kernels
# from 17 tokens, no upper bound). CUDA only. Run from the repo root:
#
#     bash bench/gdn_prompt_variants.sh           # ~5 min
#     LENGTHS=16,100 VARIANTS="32:ieee:16 32:tf32x3:16" bash bench/gdn_prompt_variants.sh   # fewer
set -u
export PYTHONUNBUFFERED=1
here=$PWD
lengths=${LENGTHS:-16,64,100,128,300}
prefill() {  # DIR ENV...: bench.prefill from that tree under that environment, its TTFT lines
  local dir=$1
  shift
  (cd "$dir" && env PYTHONPATH="$dir" "$@" timeout 150 python3 -m bench.prefill --shape qwen3.5-0.8b \
    --precision fp16 --context 2048 --lengths "$lengths" --repeats 5 2>&1 | grep "prompt ")
}
echo "# sequential kernel (up to 128 tokens; the torch path's chunked form beyond)"
prefill "$here" ONNXGEN_GDN_CHUNKED_FROM=0
echo "# sequential kernel, the norms and the gate as their own kernels first"
prefill "$here" ONNXGEN_GDN_CHUNKED_FROM=0 ONNXGEN_GDN_PROMPT_FOLD=0
for variant in ${VARIANTS:-32:ieee:16 32:ieee:32 16:ieee:16 64:ieee:16 32:tf32x3:16 64:tf32x3:16}; do
  IFS=: read -r chunk precision columns <<<"$variant"
  copy=$(mktemp -d)
  cp -r onnxgen bench pyproject.toml "$copy/"
  sed -i "s/^CHUNK = [0-9]*/CHUNK = $chunk/; s/input_precision=\"ieee\"/input_precision=\"$precision\"/;
    s/^STATE_COLUMNS = [0-9]*/STATE_COLUMNS = $columns/" "$copy/onnxgen/runtime/gpu/gated_delta_chunked.py"
  echo "# chunked kernels from 17 tokens: CHUNK $chunk, $precision products, $columns state columns"
  prefill "$copy" ONNXGEN_GDN_CHUNKED_TO=0
  rm -rf "$copy"
done
echo "# sequential kernel again, then unfolded again"
prefill "$here" ONNXGEN_GDN_CHUNKED_FROM=0
prefill "$here" ONNXGEN_GDN_CHUNKED_FROM=0 ONNXGEN_GDN_PROMPT_FOLD=0

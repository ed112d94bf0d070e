#!/usr/bin/env bash
# Issue 21 on the GPU machine: bench.peers_decode for the Qwen3.5 shapes, in calls that each end inside
# the device's 10-minute limit. From the repo root, one device call each, chained closely (the
# machine keeps /tmp only while warm):
#
#   the onnxruntime-gpu / onnxruntime-genai-cuda set-up calls (.wcK/stash.sh: bench/peers_decode.py's docstring)
#   bash bench/hybrid_peers_device.sh 0.8b fp16   # the 0.8B table (checkpoint, both builders' packages, engines)
#   bash bench/hybrid_peers_device.sh 0.8b int4
#   bash bench/hybrid_peers_device.sh build-35b   # onnxgen's 35B-A3B int4 package from RandomSource, on every
#                                                 # core (needs no onnxruntime-genai; its log lands in $OUT)
#   bash bench/hybrid_peers_device.sh 35b         # the 35B-A3B table on that package
#   bash bench/hybrid_peers_device.sh profile 0.8b [fp16|int4]   # TTFT with and without the prompt kernels (16, 64,
#                                                    # 300 and 1,024 tokens), then where a short prompt's time goes
#                                                    # (both precisions without the third argument: two calls' work)
#   bash bench/hybrid_peers_device.sh profile 35b    # the same on the 35B-A3B package (after build-35b), then
#                                                    # the decode step's anatomy (bench.step_anatomy --kernels)
#
# Tables land in $OUT. Optional llama.cpp row for the 0.8B shape: LLAMACPP=/tmp/lc TOKENIZER_FROM=<dir
# with a Qwen2.5 tokenizer.json> (bench/llamacpp_peer.py says how to build the tree and where a tokenizer
# comes from). The 0.8B stages build packages from a Hugging Face checkpoint, for which onnxgen's builder
# imports gguf (its tokenizer module); that machine has none: carry a gguf wheel into /tmp/site, or build
# llama.cpp first (bash bench/h200.sh llamacpp), whose gguf-py is then used (below).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# onnxgen's package builder needs gguf (its tokenizer module), which that machine lacks: where no gguf was
# carried, the gguf-py of the llama.cpp tree the llamacpp stage unpacked serves
python3 -c "import gguf" 2>/dev/null || { [ -d /tmp/lc/gguf-py ] && export PYTHONPATH=$PYTHONPATH:/tmp/lc/gguf-py; }
out=${OUT:-/tmp}
w08=/tmp/peers-qwen3.5-0.8b
w35=/tmp/peers-qwen3.5-35b-a3b
engines08=onnxgen,onnxgen-eager,ort-genai-graph,ort-genai,ort-genai-own-graph,ort-genai-own,onnxgen-on-genai,hf-eager
# no checkpoint fits the disk for 35B-A3B, so only the engines on onnxgen's package (peers_decode --plan)
engines35=onnxgen,onnxgen-eager,ort-genai-graph,ort-genai
run35=(python3 -m bench.peers_decode --shape qwen3.5-35b-a3b --precision int4 --workdir "$w35" --memory-gb 120)

package35() {  # the 35B-A3B package build-35b wrote, or nothing
  compgen -G "$w35/pkg-qwen3.5-35b-a3b-int4-cuda-gqa-seed*[0-9]" | head -1
}

site() {  # onnxruntime-gpu 1.31.1 and onnxruntime-genai-cuda 0.18, installed by the set-up calls
  # shellcheck disable=SC1091
  source /tmp/site-env.sh || { echo "no /tmp/site-env.sh: run the .wcK/stash.sh set-up calls first"; exit 2; }
}

case "${1:-}" in
  build-35b)
    mkdir -p "$w35"
    # the package does not depend on the engines; onnxgen alone needs no onnxruntime-genai
    "${run35[@]}" --engines onnxgen --plan || exit 2
    "${run35[@]}" --engines onnxgen --build-only 2>&1 | tee "$out/peers-qwen3.5-35b-a3b-build.log"
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
    if [ -z "$(package35)" ]; then
      echo "no 35B-A3B package under $w35: call build-35b first (the build and the table may not fit one call)"
      exit 3
    fi
    site
    "${run35[@]}" --engines "$engines35" | tee "$out/peers-qwen3.5-35b-a3b-int4.md"
    ;;
  profile)
    # bench.prefill: TTFT per prompt length, then one prefill per length under the profilers (the top
    # GPU kernels, host synchronisations); needs no onnxruntime-genai
    case "${2:-}" in
      0.8b)
        # the defaults (the conv prompt kernel; the chunked Gated DeltaNet kernels from 17 tokens) against the
        # torch path's conv, the sequential kernel up to 128 tokens, and the torch path's chunked form past
        # 128 tokens, in one process per precision
        for p in ${3:-fp16 int4}; do
          python3 -m bench.prefill --shape qwen3.5-0.8b --precision "$p" --context 2048 --lengths 16,64,300,1024 \
            --repeats 5 --variant default: --variant conv-torch:ONNXGEN_CONV_PROMPT=0 \
            --variant gdn-sequential:ONNXGEN_GDN_CHUNKED_FROM=0 --variant gdn-torch-past-128:ONNXGEN_GDN_CHUNKED_TO=128 \
            --variant default-again: | tee "$out/prefill-qwen3.5-0.8b-$p-variants.log"
          # a user's prompts: 40 lengths between 16 and 300 tokens, each once (first sightings included)
          python3 -m bench.prefill --shape qwen3.5-0.8b --precision "$p" --context 2048 --lengths 16,300 --mixed 40 \
            | tee "$out/prefill-qwen3.5-0.8b-$p-mixed.log"
          python3 -m bench.prefill --shape qwen3.5-0.8b --precision "$p" --context 2048 --lengths 16,64 --repeats 5 \
            --profile --top 25 | tee "$out/prefill-qwen3.5-0.8b-$p.log"
        done
        ;;
      35b)
        pkg=$(package35)
        [ -n "$pkg" ] || { echo "no 35B-A3B package under $w35: call build-35b first"; exit 3; }
        python3 -m bench.prefill --package "$pkg" --context 2048 --lengths 16,64 --repeats 5 --profile --top 25 \
          | tee "$out/prefill-qwen3.5-35b-a3b-int4.log"
        # and where a decode step goes (at 9x its bytes floor on 2026-12-04): host, GPU, kernel timeline
        python3 -m bench.step_anatomy --package "$pkg" --context 2048 --kernels \
          | tee "$out/anatomy-qwen3.5-35b-a3b-int4.log"
        ;;
      *) echo "usage: $0 profile 0.8b [fp16|int4] | profile 35b"; exit 2 ;;
    esac
    ;;
  *)
    echo "usage: $0 0.8b fp16|int4 | build-35b | 35b | profile 0.8b [fp16|int4] | profile 35b"
    exit 2
    ;;
esac

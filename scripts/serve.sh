#!/usr/bin/env bash
# The main job: the real tritonserver on 127.0.0.1 with model_repository/ (preprocess -> mm_llm
# ensemble) and the embedded default model (tiny Qwen2.5-Omni), after building the environment and the
# checkpoints if needed. Ctrl-C stops everything (engine processes and shared memory included).
#
#   scripts/serve.sh [--model DIR] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
#
# --model DIR      serve another local checkpoint (sets MMSERVE_MODEL for preprocess and mm_llm)
# Environment: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache on the CPU, default 2), MMSERVE_VENV.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

http=8000 grpc=8001 metrics=8002
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) export MMSERVE_MODEL=$(cd "$2" && pwd); shift 2 ;;
    --http-port) http=$2; shift 2 ;;
    --grpc-port) grpc=$2; shift 2 ;;
    --metrics-port) metrics=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

bash scripts/setup_env.sh
VENV=${MMSERVE_VENV:-$ROOT/.venv}
"$VENV/bin/python" -m mmserve_dev.tiny_models
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}

hint="Try it:
  $VENV/bin/python client/mm_client.py \"Describe the picture.\" --image examples/media/picture.png --audio examples/media/tone.wav --url {grpc}
  $VENV/bin/python client/mm_client.py \"Hello\" --protocol http --url {http} --no-stream"
exec "$VENV/bin/python" -m mmserve_dev.triton --model-repository "$ROOT/model_repository" \
  --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" \
  --shm-default-byte-size $((32 * 1024 * 1024)) --keep-loaded mm_llm,mm_ensemble --hint "$hint"

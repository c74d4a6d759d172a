#!/usr/bin/env bash
# The main job: the real tritonserver on 127.0.0.1 with model_repository/ (preprocess -> mm_llm
# ensemble) and the embedded default model (tiny Qwen2.5-Omni), after building the environment and the
# checkpoints if needed, and the OpenAI-compatible gateway beside it once the server is ready.
# Ctrl-C, SIGTERM or SIGHUP stops everything (generations in flight get 5 s, then engine processes
# and shared memory go too); if this script is killed, everything it started goes with it.
#
#   scripts/serve.sh [--model DIR] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
#                    [--openai-port 9000 | --no-openai] [--preset NAME] [--encoder]
#
# --model DIR      serve another local checkpoint (sets MMSERVE_MODEL for preprocess and mm_llm)
# --preset NAME    engine arguments of deploy/presets/NAME/model.json (a real checkpoint: with --model DIR)
# --openai-port N  the gateway's port (/v1/chat/completions, /v1/models, /health; default 9000)
# --no-openai      tritonserver alone
# --encoder        also model_repository_encoder/: the encode model and mm_ensemble_encoded
# Environment: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache on the CPU, default 2), MMSERVE_VENV.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

http=8000 grpc=8001 metrics=8002 openai=9000 preset="" encoder=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) export MMSERVE_MODEL=$(cd "$2" && pwd); shift 2 ;;
    --http-port) http=$2; shift 2 ;;
    --grpc-port) grpc=$2; shift 2 ;;
    --metrics-port) metrics=$2; shift 2 ;;
    --openai-port) openai=$2; shift 2 ;;
    --no-openai) openai=""; shift ;;
    --preset) preset=$2; shift 2 ;;
    --encoder) encoder=1; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

bash scripts/setup_env.sh
VENV=${MMSERVE_VENV:-$ROOT/.venv}
"$VENV/bin/python" -m mmserve_dev.tiny_models
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}

# --preset: a copy of the repository whose mm_llm/model.json (which preprocess reads too) is the preset's.
repository="$ROOT/model_repository"
if [[ -n $preset ]]; then
  [[ -f deploy/presets/$preset/model.json ]] || { echo "no preset $preset in deploy/presets" >&2; exit 2; }
  "$VENV/bin/python" -c 'import os, sys; from mmserve.inputs import read_engine_config
model = read_engine_config(sys.argv[1])["model"]
os.path.isdir(model) or sys.exit(f"the checkpoint {model} is not there: give --model DIR")' "deploy/presets/$preset/model.json"
  repository="${TMPDIR:-/tmp}/mmserve-preset-$preset-$(id -u)"
  rm -rf "$repository" && cp -r "$ROOT/model_repository" "$repository"
  cp "deploy/presets/$preset/model.json" "$repository/mm_llm/model.json"
fi

hint="Try it:
  $VENV/bin/python client/mm_client.py \"Describe the picture.\" --image examples/media/picture.png --audio examples/media/tone.wav --url {grpc}
  $VENV/bin/python client/mm_client.py \"Hello\" --protocol http --url {http} --no-stream"
openai_args=()
if [[ -n $openai ]]; then
  openai_args=(--openai-port "$openai")
  hint+="
  curl -s http://127.0.0.1:{openai}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{\"model\": \"mm_ensemble\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 16}}'"
fi
# exec: this script's process becomes the launcher, which stops everything on SIGINT/SIGTERM/SIGHUP
# (also when started in the background, where SIGINT starts ignored) and takes tritonserver and the
# gateway along if it is killed (mmserve_dev.triton).
repositories=(--model-repository "$repository") keep=mm_llm,mm_ensemble
if [[ -n $encoder ]]; then
  repositories+=(--model-repository "$ROOT/model_repository_encoder") keep+=,mm_ensemble_encoded
fi
exec "$VENV/bin/python" -m mmserve_dev.triton "${repositories[@]}" \
  --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" "${openai_args[@]}" \
  --shm-default-byte-size $((32 * 1024 * 1024)) --keep-loaded "$keep" --hint "$hint"

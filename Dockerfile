# mmserve GPU image: Triton Inference Server (Python backend) + vLLM 0.32.0 (CUDA) + this project.
#
#   docker build -t mmserve .
#   docker run --gpus all --shm-size=2g --stop-timeout=40 -p 8000-8002:8000-8002 mmserve   # tiny built-in model
#   docker run --gpus all --shm-size=2g --stop-timeout=40 -p 8000-8002:8000-8002 \
#       -v /path/to/Qwen2.5-Omni-7B:/models/omni:ro -e MMSERVE_MODEL=/models/omni mmserve
#
# It runs as the non-root user triton-server (UID/GID 1000): a mounted checkpoint must be readable by it.
# See docker/README.md; Kubernetes: deploy/kubernetes/, docs/DEPLOYMENT.md. Versions:
# * tritonserver 25.10 (Triton 2.62): Ubuntu 24.04 with Python 3.12, CUDA 13.0.2. vLLM 0.32.0 needs
#   Python >=3.11,<3.15 (the 24.xx releases before 24.12 ship 3.10); its torch 2.13.0 from PyPI is a
#   CUDA 13.0 build, the same CUDA minor as this base (host driver R580 or later).
# * the Python packages the project is tested with (requirements/lock.txt), where vLLM allows them.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.10-py3
FROM ${TRITON_IMAGE} AS runtime

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu 24.04 marks the system Python externally managed (PEP 668); this image *is* the environment,
# and the Python-backend stub embeds exactly this interpreter, so packages go into it.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8

# A C compiler and Python headers: OpenAI Triton (vLLM's and torch.compile's kernels) builds its small
# C launchers at run time. curl: the HEALTHCHECK. DL3008 (unpinned apt versions) is ignored on purpose:
# these are Ubuntu's security-updated builds for the pinned base image; exact versions drop off the
# archive (and libc6-dev must equal the base image's libc6), so pinning them would break the build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential python3-dev python3-pip curl \
    && rm -rf /var/lib/apt/lists/*

# vLLM's CUDA wheel brings torch 2.13.0 (+cu13.0 runtime libs), torchvision, flashinfer and the rest of
# its requirements; the project's own runtime needs are pinned beside it (lock.txt versions).
RUN python3 -m pip install \
        "vllm==0.32.0" \
        "transformers==5.19.0" \
        "tritonclient[grpc,http]==2.73.0" \
        "numpy==2.3.5" \
        "pillow==13.0.0" \
        "soundfile==0.14.0" \
        "soxr==1.1.0" \
        "av==18.1.0"

# Optional: FlashInfer's precompiled kernels for the flashinfer-python that vLLM pins (0.7.0.post1),
# which vLLM otherwise JIT-compiles at the first engine start (what `vllm download-kernels` installs;
# that CLI cannot run in a build without a GPU). They are not on PyPI: pass the index that serves them,
# --build-arg FLASHINFER_INDEX_URL=<index root> (its /cu130 sub-index holds the jit cache).
ARG FLASHINFER_INDEX_URL=""
RUN if [ -n "${FLASHINFER_INDEX_URL}" ]; then \
        python3 -m pip install --no-deps --index-url "${FLASHINFER_INDEX_URL}" \
            "flashinfer-cubin==0.7.0.post1" \
        && python3 -m pip install --no-deps --index-url "${FLASHINFER_INDEX_URL}/cu130" \
            "flashinfer-jit-cache==0.7.0.post1+cu130"; \
    fi

# The project's runtime package `mmserve` (no dependencies: all installed above). Its development
# tooling (tools/: the CPU tritonserver launcher, the tiny-checkpoint builder, the HF reference) is not
# installed in this image; only the tiny-models stage below uses it.
WORKDIR /opt/mmserve/project
COPY pyproject.toml README.md ./
COPY src ./src
RUN python3 -m pip install --no-deps --no-build-isolation . \
    && rm -rf build src/*.egg-info \
    && python3 -c "import torch, transformers, vllm, tritonclient.grpc, soundfile, soxr, av, mmserve.serving.llm, mmserve.serving.preprocess; from importlib.metadata import entry_points; assert 'mmserve' in {e.name for e in entry_points(group='vllm.general_plugins')}; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"

# Tiny deterministic checkpoints (random weights): what the image serves without a mounted model, and
# what the project's end-to-end tests are computed against. model.json's default "../../models/
# qwen2_5_omni" is relative to /opt/mmserve/model_repository/mm_llm -> /opt/mmserve/models/qwen2_5_omni
# (preprocess resolves the same path from its own folder).
# Built in a stage of their own with the tooling package, so that the final image carries the
# checkpoints and not the tooling.
FROM runtime AS tiny-models
COPY tools /opt/mmserve/tools
RUN python3 -m pip install --no-deps --no-build-isolation /opt/mmserve/tools \
    && python3 -m mmserve_dev.tiny_models --out /opt/mmserve/models

FROM runtime
WORKDIR /opt/mmserve
COPY --from=tiny-models /opt/mmserve/models ./models
COPY model_repository ./model_repository
COPY model_repository_encoder ./model_repository_encoder
COPY docker/model.gpu.json ./model_repository/mm_llm/model.json

# Checkpoints are local directories: never reach for the Hugging Face Hub or send usage stats.
# MMSERVE_MODEL (unset here) names a mounted checkpoint directory for preprocess and mm_llm alike.
ENV HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

# 8000-8002: Triton (HTTP, gRPC, metrics); 9000: the OpenAI gateway, which runs in a container of
# its own from this image (`python3 -m mmserve.gateway`, deploy/kubernetes/deployment.yaml).
EXPOSE 8000 8001 8002 9000

# The user the server runs as: `triton-server`, UID/GID 1000. NGC's tritonserver images create it
# themselves (Triton's build.py: useradd triton-server, then asserts UID and GID 1000, after deleting
# Ubuntu 24.04's own UID-1000 user `ubuntu`), without a home directory; created here only if missing
# (another base image), so the build works either way and fails if UID 1000 is someone else. Its home
# holds what vLLM, FlashInfer and OpenAI Triton compile and cache at run time (~/.cache, ~/.triton);
# made here, after every build step that runs as root, so that nothing root-owned lands in it.
RUN if ! id -u triton-server >/dev/null 2>&1; then \
        if id -u ubuntu >/dev/null 2>&1; then userdel ubuntu; fi; \
        if getent group ubuntu >/dev/null; then groupdel ubuntu; fi; \
        useradd --uid 1000 --user-group --shell /bin/bash triton-server; \
    fi \
    && [ "$(id -u triton-server)" -eq 1000 ] && [ "$(id -g triton-server)" -eq 1000 ] \
    && mkdir -p /home/triton-server/.cache \
    && chown -R 1000:1000 /home/triton-server
ENV HOME=/home/triton-server

# Everything above is root's and world-readable; the server writes only to /dev/shm and its home.
USER 1000:1000

# Ready only once every model (the vLLM engine included) has loaded: give a 7B checkpoint time.
# DL3025 (JSON form) is ignored on purpose: Docker wants exit status 1 for "unhealthy" (2 is reserved),
# and the shell maps curl's own codes (7, 22, 28, ...) to 1.
# hadolint ignore=DL3025
HEALTHCHECK --interval=30s --timeout=10s --start-period=900s --retries=3 \
    CMD curl -fsS -o /dev/null http://127.0.0.1:8000/v2/health/ready || exit 1

# The NGC image's entrypoint (/opt/nvidia/nvidia_entrypoint.sh) stays; it execs this command. The
# Python backend's shared-memory pool starts at 32 MiB per model instance (as in the test suite's
# server) instead of 1 MiB, for image/audio feature tensors: run with --shm-size (docker/README.md).
# Explicit model control with every model loaded: mm_llm unloads itself after an engine failure and
# the keeper loads it back (docs/RELIABILITY.md). On SIGTERM tritonserver finishes what is in flight
# and unloads the models within --exit-timeout-secs (Triton's default, spelled out): stop the container
# with more time than that (docker run --stop-timeout=40; Kubernetes: terminationGracePeriodSeconds).
# `python3 -m mmserve.operator` puts Triton's repository, shared-memory, logging and trace APIs (and
# mm_llm's drain) behind the operator's key, then execs tritonserver: the key is MMSERVE_OPERATOR_KEY
# (a secret), else the file MMSERVE_OPERATOR_KEY_FILE names, else a new one written there
# (docs/SECURITY.md).
ENV MMSERVE_OPERATOR_KEY_FILE=/tmp/mmserve-operator-key
CMD ["python3", "-m", "mmserve.operator", \
     "tritonserver", "--model-repository=/opt/mmserve/model_repository", \
     "--model-control-mode=explicit", "--load-model=*", \
     "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", \
     "--exit-timeout-secs=30", \
     "--backend-config=python,shm-default-byte-size=33554432"]

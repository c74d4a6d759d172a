"""Every ``MMSERVE_*`` environment variable of the project: its name, default and meaning, in one place.

The Python code reads them through these objects (``MODEL.get()``); the shell scripts read the ones
marked so with the same names and defaults. ``tests/test_settings.py`` checks that no other
``MMSERVE_*`` name appears anywhere in the repository and that Python reads none of them directly.
Importing this module changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import overload


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    """The value when unset or empty (``None``: none; descriptions of computed defaults in ``meaning``)."""
    meaning: str
    read_by: str

    @overload
    def get(self, default: str) -> str: ...

    @overload
    def get(self, default: None = None) -> str | None: ...

    def get(self, default: str | None = None) -> str | None:
        """The variable's value; unset or empty gives ``default``, else the declared default."""
        value = os.environ.get(self.name)
        if value:
            return value
        return default if default is not None else self.default


# -- serving (the Triton models, the image) --------------------------------------------------------
MODEL = EnvVar(
    "MMSERVE_MODEL",
    None,
    "checkpoint directory to serve, over `model` in mm_llm/model.json; preprocess and mm_llm alike "
    "(`scripts/serve.sh --model DIR` sets it)",
    "mmserve.inputs.resolve_model",
)
OPENAI_API_KEY = EnvVar(
    "MMSERVE_OPENAI_API_KEY",
    None,
    "the key the OpenAI gateway requires (`Authorization: Bearer KEY`) on /v1 when it has no `--api-key` "
    "(vLLM's VLLM_API_KEY; /health stays open); the launcher's `--openai-api-key` sets it for the gateway it starts",
    "mmserve.gateway.__main__, mmserve_dev.triton",
)

OPERATOR_KEY = EnvVar(
    "MMSERVE_OPERATOR_KEY",
    None,
    "the operator's key (docs/SECURITY.md): Triton's repository, shared-memory, logging and trace APIs "
    "and mm_llm's drain answer only a request that carries it. tritonserver, its stubs, the keeper and "
    "the drain read the same value; set it from a secret. Unset: the CPU launcher makes one per start "
    "(and writes it to MMSERVE_OPERATOR_KEY_FILE when that is set)",
    "mmserve.operator",
)
OPERATOR_KEY_FILE = EnvVar(
    "MMSERVE_OPERATOR_KEY_FILE",
    None,
    "a file holding the operator's key (a mounted secret), read when MMSERVE_OPERATOR_KEY is unset; "
    "the CPU launcher writes the key it made there (mode 0600)",
    "mmserve.operator",
)

# -- development tooling (mmserve_dev, tests, benchmarks, scripts) --------------------------------
CACHE_DIR = EnvVar(
    "MMSERVE_CACHE_DIR",
    None,
    "where the CPU launcher lays out tritonserver's Python backend (`<dir>/triton`; default "
    "`$XDG_CACHE_HOME/mmserve/triton`, else `~/.cache/mmserve/triton`)",
    "mmserve_dev.triton.install",
)
MODELS_DIR = EnvVar(
    "MMSERVE_MODELS_DIR",
    None,
    "where the tests build and find the tiny checkpoints (default: `models/` in the repository)",
    "tests/conftest.py",
)
TRITON_GRPC_URL = EnvVar(
    "MMSERVE_TRITON_GRPC_URL",
    None,
    "run the live tests against this running server (`host:port`, e.g. a container) instead of starting one",
    "tests/conftest.py",
)
TRITON_HTTP_URL = EnvVar(
    "MMSERVE_TRITON_HTTP_URL",
    None,
    "that server's HTTP endpoint (`host:port`); its HTTP tests skip without it",
    "tests/conftest.py",
)
TRITON_METRICS_URL = EnvVar(
    "MMSERVE_TRITON_METRICS_URL",
    None,
    "that server's metrics endpoint (`host:port`); its metrics tests skip without it",
    "tests/conftest.py",
)
VENV = EnvVar(
    "MMSERVE_VENV",
    None,
    "the project's virtual environment (default: `.venv` in the repository)",
    "scripts/setup_env.sh, scripts/test.sh, scripts/serve.sh, tests (perf_analyzer)",
)
PYTHON = EnvVar(
    "MMSERVE_PYTHON",
    None,
    "the interpreter the venv is built from (default: python3.11, else python3; must be 3.11)",
    "scripts/setup_env.sh",
)
TORCH_SPEC = EnvVar(
    "MMSERVE_TORCH_SPEC",
    "torch==2.13.0+cpu",
    "the torch requirement the venv installs",
    "scripts/setup_env.sh",
)

RUNTIME_LORA_UPDATING = EnvVar(
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    None,
    "`true` or `1`: the OpenAI gateway serves /v1/load_lora_adapter and /v1/unload_lora_adapter for the "
    "operator (its `--allow-runtime-lora-updating`; vLLM's own variable, as `vllm serve` reads it)",
    "mmserve.gateway.__main__",
)

CONTAINER_TESTS = EnvVar(
    "MMSERVE_CONTAINER_TESTS",
    None,
    "the container tests (tests/test_container.py: the CPU image built and run on a Docker engine, the one "
    "that answers or one started as root): unset, they run where an engine answers or can be started and are "
    "skipped with the reason elsewhere; `0`: skipped; `1`: required (no engine fails them)",
    "tests/test_container.py",
)

COMPOSE_IMAGE = EnvVar(
    "MMSERVE_IMAGE",
    "mmserve-cpu",
    "the image deploy/compose.yaml runs (scripts/build_image.sh's tag)",
    "deploy/compose.yaml",
)
COMPOSE_BIND = EnvVar(
    "MMSERVE_BIND",
    "0.0.0.0",
    "the address deploy/compose.yaml publishes the OpenAI gateway on (127.0.0.1: this machine only)",
    "deploy/compose.yaml",
)
COMPOSE_OPENAI_PORT = EnvVar(
    "MMSERVE_OPENAI_PORT", "9000", "the port deploy/compose.yaml publishes the OpenAI gateway on", "deploy/compose.yaml"
)
COMPOSE_TRITON_CPUS = EnvVar(
    "MMSERVE_TRITON_CPUS",
    "0",
    "the CPU limit of deploy/compose.yaml's Triton container (docker's --cpus; 0: none). A CPU engine beside "
    "its gateway on one host: the host's cores minus a half, so that the gateway is never starved "
    '(docs/DEPLOYMENT.md, "CPU engines: one scheduling group")',
    "deploy/compose.yaml",
)

ALL: tuple[EnvVar, ...] = (
    MODEL,
    OPENAI_API_KEY,
    RUNTIME_LORA_UPDATING,
    OPERATOR_KEY,
    OPERATOR_KEY_FILE,
    CACHE_DIR,
    MODELS_DIR,
    TRITON_GRPC_URL,
    TRITON_HTTP_URL,
    TRITON_METRICS_URL,
    VENV,
    PYTHON,
    TORCH_SPEC,
    CONTAINER_TESTS,
    COMPOSE_IMAGE,
    COMPOSE_BIND,
    COMPOSE_OPENAI_PORT,
    COMPOSE_TRITON_CPUS,
)

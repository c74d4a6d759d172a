"""The runtime package apart from the tooling: what the GPU image installs (`pip install .` at the
repository root) holds `mmserve` only; the tooling is its own distribution (`tools/`)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from utils import ROOT

_IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")


def _wheel(files: list[Path], base: Path, tmp: Path) -> dict[str, bytes]:
    """Build a wheel from a copy of ``files`` (a build writes build/ and egg-info into its source)."""
    source = tmp / "source"
    for path in files:
        target = source / path.relative_to(base)
        if path.is_dir():
            shutil.copytree(path, target, ignore=_IGNORE)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _packages(wheel: dict[str, bytes]) -> set[str]:
    return {name.split("/")[0] for name in wheel if not name.split("/")[0].endswith(".dist-info")}


@pytest.fixture(scope="module")
def runtime_wheel(tmp_path_factory) -> dict[str, bytes]:
    files = [ROOT / "pyproject.toml", ROOT / "README.md", ROOT / "src"]
    return _wheel(files, ROOT, tmp_path_factory.mktemp("runtime"))


def test_the_runtime_wheel_holds_mmserve_only(runtime_wheel):
    assert _packages(runtime_wheel) == {"mmserve"}
    stems = {Path(name).stem for name in runtime_wheel if name.endswith(".py")}
    assert not stems & {"triton_server", "tiny_models", "hf_reference", "samples", "benchmarking", "numpy2_compat"}
    for module in (
        "mmserve/passthrough/processor.py",
        "mmserve/serving/llm.py",
        "mmserve/serving/preprocess/processor.py",
        "mmserve/client.py",
        "mmserve/vllm_seam.py",
        "mmserve/settings.py",
    ):
        assert module in runtime_wheel, module
    entry_points = next(text for name, text in runtime_wheel.items() if name.endswith(".dist-info/entry_points.txt"))
    assert b"[vllm.general_plugins]\nmmserve = mmserve.passthrough:register" in entry_points
    assert b"console_scripts" not in entry_points  # the tiny-model builder's script is the tooling's


def test_the_tooling_is_its_own_distribution(tmp_path):
    wheel = _wheel([ROOT / "tools"], ROOT / "tools", tmp_path)
    assert _packages(wheel) == {"mmserve_dev"}
    assert {"mmserve_dev/triton/numpy2_compat.py", "mmserve_dev/tiny_models.py"} <= set(wheel)


def test_the_runtime_imports_no_tooling():
    """No module of the runtime imports mmserve_dev (the image doesn't have it)."""
    offenders = []
    for path in (ROOT / "src" / "mmserve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] == "mmserve_dev"]
    assert not offenders, offenders


@pytest.mark.parametrize(
    "module", ["mmserve.client", "mmserve.gateway.app", "mmserve.families", "mmserve.errors", "mmserve.vllm_seam"]
)
def test_light_modules_load_no_engine(module):
    """The client and the gateway need tensor names and errors only: importing them must not load
    vLLM or torch (7 s at start, and seconds to tear them down at a stop)."""
    code = f"import sys, {module}; print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"importing {module} loads {loaded.strip()}"

"""The vLLM seam (no engine): the installed vLLM is the one ``mmserve.vllm_seam`` was written for,
a mismatch says so clearly, and no other module of the package reaches into vLLM's internals."""

from __future__ import annotations

import ast
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmserve import vllm_seam

SRC = Path(vllm_seam.__file__).resolve().parent
SEAM = Path(vllm_seam.__file__).resolve()

PUBLIC = {
    # vLLM's documented entry points (top-level ``vllm`` names and the modules that define them)
    "vllm": {"AsyncEngineArgs", "LLM", "ModelRegistry", "RequestOutput", "SamplingParams", "TokensPrompt"},
    "vllm.engine.arg_utils": {"AsyncEngineArgs"},
    "vllm.outputs": {"RequestOutput"},
    "vllm.lora.request": {"LoRARequest"},  # what vLLM's LoRA docs import
    "vllm.sampling_params": {"RequestOutputKind", "SamplingParams", "StructuredOutputsParams"},
    # the exceptions vLLM raises at its API for invalid requests
    "vllm.exceptions": {"VLLMClientError", "VLLMValidationError"},
}
"""``from <module> import <name>`` allowed outside the seam."""

INTERNAL_NAMES = {
    "MULTIMODAL_REGISTRY",
    "_maybe_apply_prompt_updates",
    "_processor_factory",
    "_validate_mm_kwargs",
    "_validate_structured_outputs",
    "engine_core",
    "parse_model_prompt",
    "register_processor",
    "render_cmpl_async",
    "supports_mm_device_do_normalize",
}
"""vLLM internals reached by attribute or name, not by import: only the seam may use them."""


def _is_vllm(module: str | None) -> bool:
    return module is not None and (module == "vllm" or module.startswith("vllm."))


def vllm_imports(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """``(line, module, name)`` of each import from vLLM (``name`` empty for ``import vllm.x``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, "") for a in node.names if _is_vllm(a.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
            yield from ((node.lineno, node.module, a.name) for a in node.names)  # type: ignore[misc]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _is_vllm(node.args[0].value.split(":")[0])
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")
        ):
            yield node.lineno, node.args[0].value, ""


def internal_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        for name in (
            getattr(node, "attr", None) if isinstance(node, ast.Attribute) else None,
            node.id if isinstance(node, ast.Name) else None,
            node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None,
            node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None,
        ):
            if name in INTERNAL_NAMES:
                yield getattr(node, "lineno", 0), name


def package_modules() -> Iterator[tuple[str, ast.AST]]:
    for path in sorted(SRC.rglob("*.py")):
        if path.resolve() != SEAM:
            yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text(), str(path))


def test_installed_vllm_is_the_supported_one():
    problem = vllm_seam.vllm_version_mismatch()
    assert problem is None, problem
    vllm_seam.check_vllm_version()


def test_the_internals_the_seam_uses_are_there():
    """Every internal class, method and parameter the seam relies on exists as written for (the
    list to work through when porting)."""
    problems = vllm_seam.seam_problems()
    assert not problems, "\n".join(problems)


def test_a_changed_internal_is_reported(monkeypatch):
    key = ("vllm.multimodal.processing", "BaseMultiModalProcessor", "_maybe_apply_prompt_updates")
    monkeypatch.setitem(vllm_seam._SIGNATURES, key, ("self", "mm_items", "mm_res", "renamed"))
    monkeypatch.setitem(vllm_seam._INTERNAL_NAMES, "NoSuchThing", "vllm.multimodal.parse")
    problems = vllm_seam.seam_problems()
    assert any("_maybe_apply_prompt_updates: parameters" in p for p in problems), problems
    assert any("vllm.multimodal.parse.NoSuchThing" in p for p in problems), problems


@pytest.mark.parametrize("installed", ["0.32.0", "0.32.0+cpu", "v0.32.0"])
def test_local_and_platform_suffixes_match(installed):
    assert vllm_seam.vllm_version_mismatch(installed) is None


def test_a_mismatched_vllm_gets_a_clear_message(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(vllm_seam.VLLMVersionError) as info:
        vllm_seam.check_vllm_version()
    message = str(info.value)
    assert f"written for vLLM {vllm_seam.VLLM_VERSION}" in message
    assert "vLLM 0.33.1 is installed" in message
    assert f"install vllm=={vllm_seam.VLLM_VERSION}" in message and "vllm_seam.py" in message
    assert "docs/upstream-vllm.md" in message
    for other in ("0.31.9", "1.32.0", "dev", ""):
        assert vllm_seam.vllm_version_mismatch(other) is not None, other


def test_the_plugin_warns_on_a_mismatch_and_still_registers(monkeypatch, caplog):
    import vllm

    from mmserve import passthrough
    from mmserve.passthrough import models

    registered = []
    monkeypatch.setattr(models, "register_models", lambda: registered.append(True))
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with caplog.at_level(logging.WARNING, logger="mmserve.passthrough"):
        passthrough.register()
    assert registered == [True]
    assert any("vLLM 0.33.1 is installed" in r.getMessage() for r in caplog.records), caplog.text


def test_the_import_check_sees_every_form():
    tree = ast.parse(
        "import vllm.v1.engine\nfrom vllm.multimodal.parse import X\nfrom vllm import SamplingParams\n"
        "def f():\n    from vllm.config import VllmConfig\n    importlib.import_module('vllm.renderers')\n"
        "from .vllm import y\nx = base._processor_factory\n"
    )
    assert sorted(vllm_imports(tree)) == [
        (1, "vllm.v1.engine", ""),
        (2, "vllm.multimodal.parse", "X"),
        (3, "vllm", "SamplingParams"),
        (5, "vllm.config", "VllmConfig"),
        (6, "vllm.renderers", ""),
    ]
    assert list(internal_names(tree)) == [(8, "_processor_factory")]


def test_no_module_but_the_seam_imports_vllm_internals():
    bad = []
    for name, tree in package_modules():
        for line, module, imported in vllm_imports(tree):
            if imported not in PUBLIC.get(module, ()):
                what = f"from {module} import {imported}" if imported else f"import {module}"
                bad.append(f"src/mmserve/{name}:{line}: {what}")
        bad += [f"src/mmserve/{name}:{line}: uses {n}" for line, n in internal_names(tree)]
    assert not bad, (
        "vLLM internals outside mmserve/vllm_seam.py (move them into the seam, or add a public name "
        "to PUBLIC):\n" + "\n".join(bad)
    )


def test_the_silent_prometheus_logger_keeps_vllms_own_out():
    """vLLM's StatLoggerManager adds a real PrometheusStatLogger unless a custom logger is one:
    with the silent one among mm_llm's loggers, it is the only Prometheus logger, and inert."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager

    from mmserve.vllm_seam import silent_prometheus_logger

    manager = StatLoggerManager(None, custom_stat_loggers=[silent_prometheus_logger()], enable_default_loggers=False)
    (logger,) = manager.stat_loggers
    assert isinstance(logger, PrometheusStatLogger) and type(logger) is silent_prometheus_logger()
    manager.record(None, None)
    manager.log()
    manager.log_engine_initialized()
    assert vars(logger) == {}  # no metric objects made

"""One source per setting: every MMSERVE_* environment variable is declared in mmserve.settings, and
Python code reads them only through it."""

from __future__ import annotations

import re
import subprocess
import sys

from mmserve import settings

from utils import ROOT

NAME = re.compile(r"\bMMSERVE_[A-Z0-9_]*[A-Z0-9]\b")


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [name for name in out.splitlines() if not name.startswith("docs/benchmarks/")]


def test_every_variable_used_anywhere_is_declared():
    declared = {var.name for var in settings.ALL}
    used: dict[str, set[str]] = {}
    for name in _tracked_files():
        try:
            text = (ROOT / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for match in NAME.findall(text):
            used.setdefault(match, set()).add(name)
    undeclared = {name: sorted(files) for name, files in used.items() if name not in declared}
    assert not undeclared, f"declare these in src/mmserve/settings.py: {undeclared}"
    # ... and each declared one is read somewhere: by name (scripts, docs) or through the module.
    python = "\n".join(
        (ROOT / name).read_text()
        for name in _tracked_files()
        if name.endswith(".py") and name != "src/mmserve/settings.py" and (ROOT / name).is_file()
    )
    attributes = {var.name: attr for attr, var in vars(settings).items() if isinstance(var, settings.EnvVar)}
    unused = {
        name
        for name in declared
        if not (used.get(name, set()) - {"src/mmserve/settings.py"})
        and not re.search(rf"\bsettings\.{attributes[name]}\b|import .*\b{attributes[name]}\b", python)
    }
    assert not unused, f"declared but never used: {unused}"


def test_python_reads_them_only_through_the_settings_module():
    direct = re.compile(r"environ(?:\.get)?[\[(]\s*['\"]MMSERVE_|getenv\(\s*['\"]MMSERVE_")
    offenders = [
        name
        for name in _tracked_files()
        if name.endswith(".py")
        and name != "src/mmserve/settings.py"
        and (ROOT / name).is_file()
        and direct.search((ROOT / name).read_text())
    ]
    assert not offenders, f"read MMSERVE_* through mmserve.settings in {offenders}"


def test_get_falls_back_to_the_default(monkeypatch):
    monkeypatch.setenv(settings.TORCH_SPEC.name, "")
    assert settings.TORCH_SPEC.get() == "torch==2.13.0+cpu"
    monkeypatch.setenv(settings.TORCH_SPEC.name, "torch==9")
    assert settings.TORCH_SPEC.get() == "torch==9"
    monkeypatch.delenv(settings.MODEL.name, raising=False)
    assert settings.MODEL.get() is None and settings.MODEL.get("x") == "x"


def test_importing_mmserve_changes_no_process_state():
    """No locale switch, no logging setup, no environment change on import (the Triton adapters own those)."""
    code = (
        "import locale, os, logging; before = (locale.setlocale(locale.LC_CTYPE), dict(os.environ), "
        "logging.getLogger().handlers[:]); import mmserve, mmserve.settings, mmserve.wire; "
        "after = (locale.setlocale(locale.LC_CTYPE), dict(os.environ), logging.getLogger().handlers[:]); "
        "assert before == after, (before[0], after[0])"
    )
    env = {"PATH": "/usr/bin:/bin", "LANG": "C", "LC_ALL": "C"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)

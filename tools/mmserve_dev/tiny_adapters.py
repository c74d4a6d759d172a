"""Tiny deterministic LoRA adapters of the tiny checkpoints (``mmserve_dev.tiny_models``), built offline
with ``peft``: what a user's fine-tune of a family looks like on disk (``adapter_config.json`` and
``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes them), on the language model's
attention and MLP projections only (the towers untouched), with random non-zero A and B so that an
adapter's greedy tokens differ from the base model's.

    python -m mmserve_dev.tiny_adapters [--out models/adapters] [--family qwen2_5_vl] [--bench]

Each adapter is ``<out>/<family>/<name>``; ``ADAPTERS`` names them with their rank. The same seed
gives byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmserve_dev.tiny_models import DEFAULT_ROOT, build_all

ADAPTERS: Mapping[str, int] = {"lora_r8": 8, "lora_r16": 16}
"""Adapter name -> rank: the tests'."""
BENCH_ADAPTERS: Mapping[str, int] = {**ADAPTERS, "lora_r8_b": 8, "lora_r16_b": 16}
"""Four adapters for ``bench/peers.py --lora-modules`` (``--bench``)."""
_PROJECTIONS = r"\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
LANGUAGE_MODEL = {"qwen2_5_vl": r"model\.language_model", "qwen2_5_omni": r"model"}
"""Families with adapters here -> their language model's modules in the HF class ``HFReference`` loads
(``model.language_model.layers.N...``; the Omni thinker alone: ``model.layers.N...``). Every attention
and MLP projection of it is adapted, none of a tower's."""
FAMILIES = tuple(LANGUAGE_MODEL)
SAVED_PREFIX = {"qwen2_5_omni": "thinker."}
"""Where the family's checkpoint holds the language model beyond that class (the Omni checkpoint's
``thinker.``): an adapter of the whole model, as users train it, names its modules from there; vLLM
maps them as it maps the checkpoint's weights."""
SCALE = 0.05
"""Standard deviation of the A and B entries: large enough to change greedy tokens of the tiny models."""
VERSION = 2
"""Bump to rebuild every adapter (what ``is_built`` compares)."""


def adapter_dir(root: Path, family: str, name: str) -> Path:
    return Path(root) / family / name


def build(family: str, checkpoint: Path, out: Path, *, rank: int, seed: int) -> Path:
    """One adapter of ``checkpoint`` at ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from mmserve_dev.hf_reference import HFReference

    model = HFReference(family, checkpoint).model
    targets = LANGUAGE_MODEL[family] + _PROJECTIONS
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, bias="none")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(
        int.from_bytes(hashlib.sha256(f"{seed}:{out.name}".encode()).digest()[:8])
    )
    with torch.no_grad():
        for name, parameter in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * SCALE)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out))
    # the base model as the user names it (a local path here); peft wrote the path it was given
    config_path = out / "adapter_config.json"
    written = json.loads(config_path.read_text())
    written["base_model_name_or_path"] = str(Path(checkpoint).resolve())
    prefix = SAVED_PREFIX.get(family)
    if prefix is not None:  # the whole model's names: the weights' keys and the target pattern
        from safetensors.torch import load_file, save_file

        weights = out / "adapter_model.safetensors"
        base = "base_model.model."
        tensors = {base + prefix + key[len(base) :]: value for key, value in load_file(str(weights)).items()}
        save_file(tensors, str(weights), metadata={"format": "pt"})
        written["target_modules"] = re.escape(prefix) + targets
    config_path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    (out / ".built").write_text(_stamp(checkpoint, rank, seed))
    return out


def with_adapter(family: str, model: Any, folder: Path) -> Any:
    """``model`` (``HFReference(family, ...).model``) with the adapter at ``folder``: the reference
    for the engine's tokens (``PeftModel``; the whole model's names read back as its own)."""
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    prefix = SAVED_PREFIX.get(family)
    if prefix is None:
        return PeftModel.from_pretrained(model, str(folder)).eval()
    saved = json.loads((Path(folder) / "adapter_config.json").read_text())
    config = LoraConfig(
        r=saved["r"],
        lora_alpha=saved["lora_alpha"],
        lora_dropout=0.0,
        target_modules=LANGUAGE_MODEL[family] + _PROJECTIONS,
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    base = "base_model.model."
    weights = {
        key.replace(base + prefix, base, 1): value
        for key, value in load_file(str(Path(folder) / "adapter_model.safetensors")).items()
    }
    unexpected = list(getattr(set_peft_model_state_dict(peft_model, weights), "unexpected_keys", ()))
    if unexpected:
        raise ValueError(f"{folder}: keys of no module of the model: {unexpected[:4]}")
    return peft_model.eval()


def _stamp(checkpoint: Path, rank: int, seed: int) -> str:
    return json.dumps({"version": VERSION, "rank": rank, "seed": seed, "checkpoint": str(Path(checkpoint).resolve())})


def is_built(checkpoint: Path, out: Path, *, rank: int, seed: int) -> bool:
    stamp = out / ".built"
    return stamp.is_file() and stamp.read_text() == _stamp(checkpoint, rank, seed)


def build_all_adapters(
    root: Path = DEFAULT_ROOT / "adapters",
    *,
    families: tuple[str, ...] = FAMILIES,
    checkpoints: Mapping[str, Path] | None = None,
    seed: int = 0,
    adapters: Mapping[str, int] = ADAPTERS,
) -> dict[str, dict[str, Path]]:
    """Every family's ``adapters`` (name -> rank) under ``root`` (built where missing): family ->
    name -> folder."""
    checkpoints = checkpoints or build_all(families=families)
    out: dict[str, dict[str, Path]] = {}
    for family in families:
        out[family] = {}
        for name, rank in adapters.items():
            folder = adapter_dir(root, family, name)
            if not is_built(checkpoints[family], folder, rank=rank, seed=seed):
                build(family, checkpoints[family], folder, rank=rank, seed=seed)
            out[family][name] = folder
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmserve_dev.tiny_adapters", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_ROOT / "adapters")
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--bench", action="store_true", help=f"also the benchmark's: {', '.join(BENCH_ADAPTERS)}")
    args = parser.parse_args(argv)
    chosen = BENCH_ADAPTERS if args.bench else ADAPTERS
    built = build_all_adapters(args.out, families=tuple(args.family or FAMILIES), adapters=chosen)
    for family, adapters in built.items():
        for name, folder in adapters.items():
            print(f"[tiny_adapters] {family} {name}: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

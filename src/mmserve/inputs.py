"""From the HF processor's output to a vLLM prompt, and engine arguments for a checkpoint."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmserve import settings
from mmserve.families import FamilySpec, family_for_architecture
from mmserve.families.base import numel


def resolve_model(configured: str | None, base_dir: str | Path) -> str:
    """The checkpoint directory to serve: ``$MMSERVE_MODEL`` if set, else ``configured`` (relative
    paths are relative to ``base_dir``, the folder of the file that configured it)."""
    model = settings.MODEL.get() or configured
    if not model:
        raise ValueError(f"no model configured in {base_dir} and {settings.MODEL.name} is not set")
    path = Path(model)
    if not path.is_absolute():
        path = (Path(base_dir) / path).resolve()
    return str(path)


def read_engine_config(path: str | Path) -> dict[str, Any]:
    """An engine configuration file (``mm_llm/model.json``: vLLM engine arguments as JSON), with
    ``model`` resolved to the checkpoint directory (``resolve_model``, relative to the file's folder).

    It is the one place the checkpoint is configured: ``preprocess`` reads the same file.
    """
    path = Path(path)
    try:
        args = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"engine config {path}: {exc}") from None
    if not isinstance(args, dict):
        raise ValueError(f"engine config {path}: expected a JSON object of engine arguments")
    args["model"] = resolve_model(args.get("model"), path.parent)
    return args


def mm_limits(engine_args: Mapping[str, Any]) -> dict[str, int]:
    """Items per prompt and modality from the engine arguments' ``limit_mm_per_prompt`` (a count, or
    vLLM's ``{"count": n, ...}`` form); modalities it leaves out are absent."""
    limits = {}
    for modality, limit in (engine_args.get("limit_mm_per_prompt") or {}).items():
        count = limit.get("count") if isinstance(limit, Mapping) else limit
        if count is not None:
            limits[modality] = int(count)
    return limits


def family_of_checkpoint(model: str | Path) -> FamilySpec:
    """The family of a local checkpoint, from the ``architectures`` of its ``config.json``."""
    config = json.loads((Path(model) / "config.json").read_text())
    architectures = config.get("architectures") or []
    for arch in architectures:
        try:
            return family_for_architecture(arch)
        except KeyError:
            continue
    raise KeyError(f"{model}: no model family serves architectures {architectures}")


def engine_kwargs(model: str | Path, **overrides: Any) -> dict[str, Any]:
    """vLLM engine arguments that serve ``model`` through the pass-through architecture.

    The checkpoint is untouched: its family's pass-through class is selected with
    ``hf_overrides={"architectures": [...]}``. ``overrides`` win over these defaults.
    """
    family = family_of_checkpoint(model)
    kwargs: dict[str, Any] = {"model": str(model), "hf_overrides": family.hf_overrides}
    kwargs.update(overrides)
    return kwargs


def processed_multi_modal_data(family: FamilySpec, tensors: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Group the HF processor's feature tensors by modality, as the pass-through parser takes them.

    A modality whose tensors are absent or empty (zero items) is left out. Tensors that belong to no
    modality of the family (``input_ids``, ``attention_mask``, ...) are ignored; the families' wire
    fields (``preprocess``'s ``pixel_values_uint8``) must be decoded first.
    """
    data: dict[str, dict[str, Any]] = {}
    for features in family.modalities:
        modality = features.modality
        wire = {name for spec in family.specs if spec.modality == modality for name in spec.wire_field_names}
        if sent := sorted(name for name in wire if numel(tensors.get(name, ())) > 0):
            raise ValueError(f"{', '.join(sent)}: decode the wire fields first (Preprocessor.decode_wire)")
        given = [name for name in family.field_names(modality) if numel(tensors.get(name, ())) > 0]
        spec = family.spec_for(modality, given)
        assert spec is not None
        # the form's own fields, sent empty or not, and whatever else was sent (refused by name)
        fields = {name: tensors[name] for name in (*spec.field_names, *given) if name in tensors}
        if given:
            data[modality] = fields
    return data


def processed_prompt(
    family: FamilySpec,
    input_ids: Sequence[int] | Any,
    tensors: Mapping[str, Any],
    *,
    item_ids: Mapping[str, list[str]] | None = None,
) -> dict[str, Any]:
    """A vLLM ``TokensPrompt`` for expanded ``input_ids`` and the processor's feature tensors;
    ``item_ids`` (per modality, an identity per item: ``FamilySpec.decode_wire``) become its
    ``multi_modal_uuids``, which vLLM takes for the items' hashes."""
    ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
    if ids and isinstance(ids[0], list):  # a batch of one, as HF processors return it
        if len(ids) != 1:
            raise ValueError(f"input_ids: expected one prompt, found a batch of {len(ids)}")
        ids = ids[0]
    prompt: dict[str, Any] = {"prompt_token_ids": [int(i) for i in ids]}
    mm_data = processed_multi_modal_data(family, tensors)
    if mm_data:
        prompt["multi_modal_data"] = mm_data
        if uuids := {modality: list(ids) for modality, ids in (item_ids or {}).items() if modality in mm_data}:
            prompt["multi_modal_uuids"] = uuids
    return prompt

"""LoRA adapters of ``mm_llm``: which ones a model serves and which one a request names.

The format is Triton's vLLM backend's, so that a repository written for that backend carries over:
``model.json`` holds vLLM's own LoRA engine arguments (``enable_lora``, ``max_loras``,
``max_lora_rank``, ``max_cpu_loras``), and ``multi_lora.json`` beside it maps each adapter's name to
its folder (``{"sql": "/adapters/sql", "chat": "chat"}``; a relative folder is read from the model's
directory). A request names its adapter with ``lora_name`` in ``sampling_parameters``; without it,
the base model answers.

Every adapter is checked when the model loads (a PEFT LoRA folder, its rank within
``max_lora_rank``), then loaded into the engine (``AsyncLLM.add_lora``: vLLM checks its modules
against the model's): a bad one fails the load with its name and the reason. A request's unknown
``lora_name`` is refused before the engine, naming it.

While serving, the operator changes the set (``parse_update``: a control request to ``mm_llm``
with the operator's key, or the gateway's ``/v1/load_lora_adapter``): adapters are loaded into the
engine before any request may name them, and one no longer served is refused to new requests while
those in flight on it finish (as ``vllm serve`` unloads one: the engine's LRU of
``max_cpu_loras`` drops its weights later). An adapter keeps its id while its folder does; a new
folder under an old name gets a new id, so no KV block computed with other weights is reused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserve.errors import InputError
from mmserve.serving.sampling import MAX_LORA_NAME_CHARS

MULTI_LORA_FILE = "multi_lora.json"
DEFAULT_MAX_LORA_RANK = 16
"""vLLM 0.32's ``LoRAConfig.max_lora_rank`` default."""


class AdapterError(ValueError):
    """A ``multi_lora.json`` or an adapter folder the model can't serve (the model does not load)."""


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int
    lora_id: int
    """vLLM's id of the adapter (1, 2, ... in ``multi_lora.json``'s order): its KV blocks and cache
    entries are keyed by it, so two adapters never share them."""

    def request(self) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=self.name, lora_int_id=self.lora_id, lora_path=str(self.path))


@dataclass(frozen=True)
class Adapters:
    """The adapters a model serves (none: LoRA off). Immutable: an update makes a new set."""

    by_name: Mapping[str, Adapter]
    enabled: bool = False
    model_dir: Path = Path()
    """Where ``multi_lora.json`` lies, and what a relative folder is read from."""
    max_rank: int = DEFAULT_MAX_LORA_RANK
    next_id: int = 1
    """The id the next new adapter gets: ids are never reused."""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, engine_args: Mapping[str, Any]) -> Adapters:
        """``model_dir``'s ``multi_lora.json`` where ``engine_args`` (``model.json``) enable LoRA."""
        if str(engine_args.get("enable_lora", False)).lower() != "true":
            return cls({})
        max_rank = int(engine_args.get("max_lora_rank", DEFAULT_MAX_LORA_RANK))
        empty = cls({}, enabled=True, model_dir=Path(model_dir), max_rank=max_rank)
        return empty.updated(empty.read_file())

    def read_file(self) -> dict[str, str]:
        """``multi_lora.json``'s entries, name -> folder."""
        file = self.model_dir / MULTI_LORA_FILE
        if not file.is_file():
            raise AdapterError(
                f"{file}: enable_lora is set in model.json, and this file naming the adapters is missing"
            )
        try:
            entries = json.loads(file.read_text())
        except ValueError as exc:
            raise AdapterError(f"{file}: not valid JSON ({exc})") from None
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise AdapterError(f'{file}: expected an object of adapter names to folders ({{"name": "/path"}})')
        return entries

    def updated(self, entries: Mapping[str, str]) -> Adapters:
        """The set that serves exactly ``entries`` (name -> folder), each checked: an adapter whose
        folder is unchanged keeps its id, any other gets a new one. ``AdapterError`` naming the
        first bad one (nothing changes)."""
        adapters: dict[str, Adapter] = {}
        next_id = self.next_id
        for name, folder in entries.items():
            if not name or len(name) > MAX_LORA_NAME_CHARS:
                raise AdapterError(f"adapter names are 1 to {MAX_LORA_NAME_CHARS} characters, found {_show(name)}")
            path = (Path(folder) if Path(folder).is_absolute() else self.model_dir / folder).resolve()
            rank = _rank(name, path, self.max_rank)
            kept = self.by_name.get(name)
            if kept is not None and kept.path == path:
                adapters[name] = Adapter(name, path, rank, kept.lora_id)
            else:
                adapters[name] = Adapter(name, path, rank, next_id)
                next_id += 1
        return Adapters(adapters, True, self.model_dir, self.max_rank, next_id)

    def new_in(self, other: Adapters) -> list[Adapter]:
        """``other``'s adapters that this set does not serve (by id): those the engine must load."""
        ids = {adapter.lora_id for adapter in self.by_name.values()}
        return [adapter for adapter in other.by_name.values() if adapter.lora_id not in ids]

    def listing(self) -> dict[str, str]:
        """name -> folder, as ``multi_lora.json`` says it."""
        return {name: str(adapter.path) for name, adapter in self.by_name.items()}

    def resolve(self, name: str | None) -> Any:
        """The engine's ``LoRARequest`` for a request's ``lora_name`` (None: the base model)."""
        if name is None:
            return None
        adapter = self.by_name.get(name)
        if adapter is None:
            if not self.enabled:
                raise InputError(
                    f"sampling_parameters: lora_name {_show(name)}: this model serves no LoRA adapters "
                    "(enable_lora is off in its model.json)"
                )
            raise InputError(
                f"sampling_parameters: lora_name {_show(name)} is not an adapter of this model "
                f"(it serves {sorted(self.by_name)})"
            )
        return adapter.request()

    def __len__(self) -> int:
        return len(self.by_name)


MAX_UPDATE_CHARS = 1 << 16
"""The longest update (JSON) an operator sends: thousands of adapters."""


def parse_update(adapters: Adapters, text: str) -> dict[str, str]:
    """An operator's update of the adapters served -> the entries to serve (``Adapters.updated``).

    ``{"load": {"name": "/folder", ...}}`` adds or replaces adapters; ``{"unload": ["name", ...]}``
    stops serving them (an unknown name is refused); ``{"reload": true}`` serves what
    ``multi_lora.json`` says now (the change that outlives a restart of the model). ``InputError``
    naming what is wrong."""
    prefix = "lora_adapters: "
    if not adapters.enabled:
        raise InputError(f"{prefix}this model serves no LoRA adapters (enable_lora is off in its model.json)")
    if len(text) > MAX_UPDATE_CHARS:
        raise InputError(f"{prefix}expected at most {MAX_UPDATE_CHARS} characters of JSON, found {len(text)}")
    try:
        update = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{prefix}invalid JSON ({exc})") from None
    if not isinstance(update, dict) or len(update) != 1 or next(iter(update)) not in ("load", "unload", "reload"):
        raise InputError(
            f'{prefix}expected one of {{"load": {{name: folder}}}}, {{"unload": [name]}}, {{"reload": true}}'
        )
    (action, value), current = next(iter(update.items())), adapters.listing()
    if action == "reload":
        if value is not True:
            raise InputError(f"{prefix}reload: expected true, found {value!r}")
        try:
            return adapters.read_file()
        except AdapterError as exc:
            raise InputError(f"{prefix}{exc}") from None
    if action == "load":
        if not isinstance(value, dict) or not value or not all(isinstance(v, str) for v in value.values()):
            raise InputError(f"{prefix}load: expected a non-empty object of adapter names to folders")
        return {**current, **value}
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise InputError(f"{prefix}unload: expected a non-empty list of adapter names")
    unknown = [name for name in value if name not in current]
    if unknown:
        raise InputError(f"{prefix}unload: {', '.join(map(_show, unknown))} not served (it serves {sorted(current)})")
    return {name: folder for name, folder in current.items() if name not in value}


def _rank(name: str, path: Path, max_rank: int) -> int:
    """A PEFT LoRA folder's rank, checked against ``max_lora_rank``."""
    config_file = path / "adapter_config.json"
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a folder")
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: {path} is not a PEFT adapter (no adapter_config.json)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise AdapterError(f"adapter {name!r}: {config_file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise AdapterError(f"adapter {name!r}: {config_file}: expected peft_type LORA, found {found!r}")
    if not any((path / weights).is_file() for weights in ("adapter_model.safetensors", "adapter_model.bin")):
        raise AdapterError(f"adapter {name!r}: {path} holds no adapter_model.safetensors (or .bin)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: {config_file}: expected a positive integer r, found {rank!r}")
    ranks = [rank, *(r for r in (config.get("rank_pattern") or {}).values() if isinstance(r, int))]
    if max(ranks) > max_rank:
        raise AdapterError(
            f"adapter {name!r}: rank {max(ranks)} exceeds max_lora_rank {max_rank} (model.json); raise it to "
            "the largest rank of the adapters served"
        )
    return max(ranks)


def _show(name: str) -> str:
    return repr(name if len(name) <= 64 else name[:64] + "...")

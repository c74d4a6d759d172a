"""What a model family declares so that its already-processed inputs can pass through vLLM.

A family is a stock vLLM model class plus, for each modality it accepts, a ``ModalitySpec``:
the tensor fields the family's HF processor outputs, the placeholder token that stands for one
embedding in the expanded prompt, how the modality's batch splits into items, and the rule that
turns one item's tensors into its placeholder count. Nothing else in the project knows these rules.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mmserve.errors import ProcessedInputError
from mmserve.wire import TensorSpec

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


FieldSpec = TensorSpec
"""One tensor of a modality, as the HF processor outputs it for all items of a request."""

WireDecoder = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
"""A modality's tensors of one request with its wire fields -> the same with ``fields`` only."""


def non_finite_count(tensor: torch.Tensor) -> int:
    """How many NaN/Inf values a floating-point tensor holds.

    Through NumPy where it can (CPU, a dtype NumPy has): one pass, 10-20x faster than
    ``torch.isfinite(t).all()``, whose parallel region stalls when the cores are busy (on the
    request path of ``mm_llm``'s stub, for every image's ``pixel_values``)."""
    import torch

    if tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64, torch.float16):
        array = tensor.detach().numpy()
        if np.isfinite(array).all():
            return 0
        return int(np.count_nonzero(~np.isfinite(array)))
    return int((~torch.isfinite(tensor)).sum())


class ModalitySpec(ABC):
    """The rules of one modality of one family.

    Subclasses implement ``validate`` (shapes, dtypes and cross-field consistency of the whole
    modality), ``fields_config`` (how vLLM splits the modality's tensors into items) and
    ``expected_tokens`` (the placeholder count of one item).
    """

    modality: str
    fields: tuple[FieldSpec, ...]
    placeholder_token: str

    enclosed_by: tuple[str, str] | None = None
    """The tokens right before and after each item's run, where the family's vLLM model relies on them
    (Qwen3-Omni's places the M-RoPE positions of a run's next token as its end marker's: a run right
    after another item's took the engine core down): the default ``locate`` refuses a run without them."""

    wire_fields: tuple[FieldSpec, ...] = ()
    """Smaller stand-ins for some of ``fields`` on the way from ``preprocess`` to ``mm_llm`` (e.g.
    image patches before the processor's normalization: a quarter of the bytes), which
    ``wire_decoder`` turns back into ``fields`` before anything else reads them."""

    @property
    def field_names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields)

    @property
    def required_field_names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields if not f.optional)

    @property
    def wire_field_names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.wire_fields)

    def wire_decoder(self, model: str | Path) -> WireDecoder | None:
        """What turns this modality's ``wire_fields`` back into ``fields`` for the checkpoint at
        ``model`` (None: the modality has no wire fields). It takes and returns the modality's
        tensors of one request, and raises ``ProcessedInputError`` for wire tensors it can't
        decode."""
        return None

    def wire_item_ids(self, tensors: Mapping[str, np.ndarray]) -> list[str] | None:
        """A content identity per item of a request's wire tensors (``tensors``: the modality's, as
        its ``wire_decoder`` took them without complaint), or None: vLLM hashes each decoded item.

        Given to vLLM as the items' ``multi_modal_uuids``, an identity stands for the item's hash in
        the prefix cache, the encoder cache and the processor cache: it must differ whenever the
        item's decoded tensors differ, and be the same for the same item in any request, alone or
        beside others (an image of an earlier turn is a cache hit)."""
        return None

    def check_fields(self, data: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Presence, type, dtype kind and rank of every field; returns the fields as tensors."""
        unknown = sorted(set(data) - self.field_names)
        if unknown:
            raise ProcessedInputError(
                self.modality,
                expected=f"only the fields {sorted(self.field_names)}",
                found=f"unexpected field(s) {unknown}",
            )
        missing = sorted(self.required_field_names - set(data))
        if missing:
            raise ProcessedInputError(
                self.modality,
                expected=f"the fields {sorted(self.required_field_names)}",
                found=f"{sorted(data)} (missing {missing})",
            )
        import torch

        tensors: dict[str, torch.Tensor] = {}
        for spec in self.fields:
            if spec.optional and numel(data.get(spec.name)) == 0:
                continue  # left out, or sent empty
            tensor = as_tensor(data[spec.name], self.modality, spec.name)
            if spec.is_float and not tensor.is_floating_point():
                raise ProcessedInputError(
                    self.modality,
                    field=spec.name,
                    expected="a floating-point tensor (the HF processor's normalized output)",
                    found=f"dtype {tensor.dtype}",
                )
            if not spec.is_float and tensor.dtype not in _integer_dtypes():
                raise ProcessedInputError(
                    self.modality,
                    field=spec.name,
                    expected="an integer tensor (int64, int32, int16, int8, uint8 or bool)",
                    found=f"dtype {tensor.dtype}",
                )
            if spec.is_float and tensor.numel() and (bad := non_finite_count(tensor)):
                # Non-finite features poison vLLM's CPU KV cache for later, unrelated requests
                # (docs/RELIABILITY.md): nothing non-finite may reach the engine.
                raise ProcessedInputError(
                    self.modality,
                    field=spec.name,
                    expected="finite values",
                    found=f"{bad} NaN/Inf value(s)",
                )
            if tensor.dtype == torch.float64 and tensor.numel() and (wide := _beyond_float32_count(tensor)):
                # The engine casts features to the model's dtype, float32 at most: 1e300 is Inf there.
                raise ProcessedInputError(
                    self.modality,
                    field=spec.name,
                    expected="values within float32's range (the engine computes in the model's dtype)",
                    found=f"{wide} value(s) beyond it",
                )
            if tensor.ndim != spec.ndim:
                raise ProcessedInputError(
                    self.modality,
                    field=spec.name,
                    expected=f"rank {spec.ndim} {spec.shape}",
                    found=f"rank {tensor.ndim} with shape {tuple(tensor.shape)}",
                )
            tensors[spec.name] = tensor
        return tensors

    @abstractmethod
    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        """Check shapes and values across fields; raise ``ProcessedInputError``.

        Every number that reaches a shape, an index, an allocation or a position in the engine must
        be bounded here by what the model can hold, with sums and products of the client's numbers
        in Python's exact integers (``tensor.tolist()``), never in int64 tensor arithmetic, which
        wraps around (a grid of t*h*w = 1 * (2**62 + 2) * 24 is 48 in int64): an input this accepts
        must not fail inside the engine (``tests/test_property_engine.py``).

        ``hf_config`` (here and below) is the model's HF config as vLLM's processing info of the
        family's model returns it (``get_hf_config()``: Qwen2.5-Omni's ``thinker_config``)."""

    def validate_limits(
        self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig, *, max_model_len: int
    ) -> None:
        """Check what depends on the engine's configuration, after ``validate`` accepted ``data``:
        ``max_model_len`` is the engine's context length (a prompt and its generation together).
        Raise ``ProcessedInputError``. The pass-through checks one bound itself for every family:
        a request's placeholders of this modality (``expected_tokens``) leave room for one generated
        token. Default: nothing more."""
        return None

    @abstractmethod
    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        """vLLM ``MultiModalFieldConfig`` (``mmserve.vllm_seam.MultiModalFieldConfig``) per field:
        how the batch splits into items."""

    @abstractmethod
    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        """Placeholder tokens one item occupies in the expanded prompt."""

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        """Short description of an item for error messages (what its count was derived from)."""
        return ""

    def locate(
        self, prompt_ids: Sequence[int], items: Any, *, token_id: int, hf_config: PretrainedConfig, tokenizer: Any
    ) -> list[Any]:
        """Where each item of ``items`` (``ProcessedItems``, validated) sits in the expanded prompt,
        in item order: ``vllm_seam.Placement`` (offset, length and, where only some of the span's
        tokens take the item's embeddings, which). Raise ``ProcessedInputError`` when the prompt does
        not hold the items as the family's processor lays them out.

        Default: one run of ``token_id`` (the placeholder) per item, of ``expected_tokens`` tokens.
        A family whose item spans more (Qwen3-VL's video: a timestamp and delimiters before every
        temporal patch) overrides it; ``tokenizer`` (the checkpoint's) reads such text."""
        from mmserve.passthrough.placeholders import locate_items
        from mmserve.vllm_seam import Placement

        runs = locate_items(
            prompt_ids,
            modality=self.modality,
            token=self.placeholder_token,
            token_id=token_id,
            expected=items.expected_tokens(),
            describe=items.describe(),
        )
        if self.enclosed_by is not None:
            start, end = self.enclosed_by
            ids = (tokenizer.convert_tokens_to_ids(start), tokenizer.convert_tokens_to_ids(end))
            for index, (offset, length) in enumerate(runs):
                before = prompt_ids[offset - 1] if offset > 0 else None
                after = prompt_ids[offset + length] if offset + length < len(prompt_ids) else None
                if (before, after) != ids:
                    raise ProcessedInputError(
                        self.modality,
                        item=index,
                        field="prompt_token_ids",
                        expected=f"its run of {self.placeholder_token} between {start} and {end}",
                        found=f"tokens {before} and {after} around the run at offset {offset}",
                    )
        return [Placement(offset, length) for offset, length in runs]

    def model_inputs(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> dict[str, torch.Tensor]:
        """The tensors the family's vLLM model takes for this modality, from the fields ``validate``
        accepted: what its stock processor hands it (the item split, the hashes and the model see
        these). Default: the fields as they are. InternVL: tiles back to (tiles, 3, H, W) from the
        wire's rows, and the model's own ``image_token_id``."""
        return dict(data)

    def complete(
        self,
        processed: Mapping[str, Any],
        input_ids: np.ndarray,
        token_id: int,
        *,
        processor: Any = None,
        items: Sequence[Any] = (),
    ) -> dict[str, Any]:
        """In ``preprocess``: the HF processor's whole output (``processed``) with this modality's
        tensors as ``fields`` names them: what the processor names otherwise renamed, what it lacks
        added, from the prompt it expanded (``input_ids``; ``token_id``: the placeholder's), the
        processor itself and this modality's decoded ``items`` in prompt order (images, the clips'
        samples, videos). Default: as is. InternVL: its processor merges every image's tiles and
        drops the tiles per image, which each image's run of placeholders tells. Audio Flamingo 3:
        ``input_features_mask`` is vLLM's ``feature_attention_mask``, and the windows of each clip
        are the processor's own cut of its samples."""
        return dict(processed)

    max_items: int | None = None
    """The most items of this modality one prompt takes, where the family's processor bounds it
    (Audio Flamingo 3's: one clip per text); ``preprocess`` refuses more with its own message."""

    max_item_seconds_replaces_window: bool = False
    """``max_item_seconds`` bounds a clip on its own, beyond the feature extractor's window (a
    processor that cuts long clips into windows itself: Audio Flamingo 3); else a clip is bounded by
    both."""

    def placeholder_runs(self, tensors: Mapping[str, Any], items: int) -> int:
        """Runs of the placeholder token that ``items`` items take in a prompt the family's processor
        expanded, from its tensors of them (``tensors``): what ``preprocess`` checks its prompt
        against. Default: one per item."""
        return items

    def processor_kwargs(self, processor: Any, items: Sequence[Any]) -> dict[str, Any]:
        """Extra keyword arguments for the HF processor's call on ``items`` (raw media of this
        modality), e.g. a cheaper padding that gives the same values wherever the model reads them.
        Default: none."""
        return {}

    def compact(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The processor's output for this modality in the smallest form that gives the model the
        same values (smaller tensors on every hop): padding the model never reads removed, wire
        fields in place of the fields they stand for. Default: as is."""
        return dict(data)

    def max_item_seconds(self, checkpoint_config: Mapping[str, Any], processor: Any) -> float | None:
        """The longest item (in seconds, for time-based media) that ``validate`` accepts for this
        checkpoint (its ``config.json`` as a dict), so that preprocessing refuses longer ones with its
        own message instead of passing them to the engine. Default: no such bound."""
        return None

    def item_rows(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """Rows of the modality's first field per item, in prompt order, from one request's tensors
        (``validate`` accepted them): how ``mmserve.encoder`` cuts a request into items to cache and
        encode them one by one. Qwen's vision: ``t*h*w`` patches of each grid; InternVL: each image's
        tiles; Whisper audio: one clip per row; Audio Flamingo 3: each clip's windows. A family
        with ``towers`` defines it for every modality they encode."""
        raise NotImplementedError(f"{type(self).__name__}: items of {self.modality} for the encoder")


@dataclass(frozen=True)
class TowerSpec:
    """One encoder tower of a family's checkpoint, loadable on its own (``mmserve.encoder``): the
    HF class, where its config sits in the checkpoint's config, and its weights' key prefix."""

    modalities: tuple[str, ...]
    """What it encodes: ``("image", "video")`` for a vision tower, ``("audio",)``."""
    hf_class: str
    """``"module:Class"`` of the transformers module."""
    config_path: tuple[str, ...]
    """Attributes from the checkpoint's config to the tower's, e.g. ``("thinker_config", "vision_config")``."""
    weights_prefix: str
    """Of the tower's keys in the checkpoint's safetensors, e.g. ``"thinker.visual."``."""
    projector: tuple[str, str] | None = None
    """``("module:Class", weights prefix)`` of a module after the tower that maps its output to the
    language model's width, built from the config above the tower's (Qwen2-Audio's
    ``multi_modal_projector``); None where the tower outputs that width itself."""
    padded: bool = False
    """An audio tower that takes every clip padded to its whole window (``2 * max_source_positions``
    frames) with a mask over the padding (Qwen2-Audio's absolute positions, Audio Flamingo 3's
    windows), not the valid frames packed together (Qwen2.5-Omni, Qwen3-Omni)."""
    tiles: bool = False
    """A vision tower over whole tiles (tiles, channels, height, width) whose patch tokens (its class
    token dropped) are pixel-shuffled by the config's ``downsample_ratio`` before the ``projector``
    (InternVL), not over Qwen's rows of patches with their grid."""


@dataclass(frozen=True)
class FamilySpec:
    """A model family served through the pass-through processor."""

    name: str
    """Short name used by the project (checkpoint builder, docs, tests)."""
    stock_architectures: tuple[str, ...]
    """``architectures`` values of checkpoints of this family."""
    passthrough_architecture: str
    """Architecture registered with vLLM; select it with ``hf_overrides={"architectures": [...]}``."""
    vllm_model: str
    """``"module:Class"`` of the stock vLLM model the pass-through class derives from."""
    modalities: tuple[ModalitySpec, ...]
    encoded: tuple[ModalitySpec, ...] = ()
    """Modalities in the form their encoder outputs (``qwen.VisionEmbeddings``,
    ``qwen.AudioEmbeddings``): what ``mm_llm`` takes in place of the features when the encoder ran
    apart (``mmserve.encoder``)."""
    towers: tuple[TowerSpec, ...] = ()
    """The encoder towers, for encoding apart from the engine (``mmserve.encoder``)."""
    audio_in_video: Any = None
    """How the family lays out a video with its audio track (``qwen.AudioInVideo``), if it takes one."""
    model_mixins: tuple[str, ...] = ()
    """``"module:Class"`` of fixes placed over the stock vLLM model class (``vllm_seam``)."""
    processor_tensors: str = "np"
    """``return_tensors`` of every call of the family's HF processor (Audio Flamingo 3's returns "pt" only)."""
    tool_call_parser: str = "hermes"
    """vLLM's tool call parser for the family's format (``vllm serve --tool-call-parser``): how a
    tool call is written (``<tool_call>{...}</tool_call>`` for the Qwen families), constrained and read."""

    def modality(self, name: str) -> ModalitySpec | None:
        return next((m for m in self.modalities if m.modality == name), None)

    @property
    def specs(self) -> tuple[ModalitySpec, ...]:
        """Every form of every modality: the features (``modalities``), then ``encoded``."""
        return (*self.modalities, *self.encoded)

    def spec_for(self, modality: str, fields: Iterable[str]) -> ModalitySpec | None:
        """The form of ``modality`` that a request's ``fields`` (names) are in: the encoded one
        when its first field (the embeddings) is among them, else the features'."""
        names = set(fields)
        encoded = next((s for s in self.encoded if s.modality == modality), None)
        if encoded is not None and encoded.fields[0].name in names:
            return encoded
        return self.modality(modality)

    @property
    def replaced_by_encoded(self) -> frozenset[str]:
        """The feature fields (wire fields too) whose place the ``encoded`` forms' own fields take:
        what an encoder consumes (``pixel_values``, ``pixel_values_uint8``, ``input_features``, ...)."""
        replaced: set[str] = set()
        for encoded in self.encoded:
            features = self.modality(encoded.modality)
            assert features is not None, encoded.modality
            kept = encoded.field_names | encoded.wire_field_names
            replaced |= (features.field_names | features.wire_field_names) - kept
        return frozenset(replaced)

    @property
    def encoder_reads(self) -> frozenset[str]:
        """What ``mmserve.encoder`` reads of ``preprocess``'s outputs: the fields it consumes, and the
        fields of each item's extent that stay beside its embeddings (Qwen's grids, InternVL's tiles
        per image)."""
        extents = {m.fields[1].name for m in self.modalities if m.modality in ("image", "video")}
        kept = frozenset().union(*(encoded.field_names for encoded in self.encoded))
        return self.replaced_by_encoded | (extents & kept) if self.encoded else frozenset()

    def field_names(self, modality: str) -> frozenset[str]:
        """The fields of every form of ``modality``."""
        return frozenset().union(*(s.field_names for s in self.specs if s.modality == modality))

    def wire_decoders(self, model: str | Path) -> dict[str, WireDecoder]:
        """Per modality that has wire fields, its decoder for the checkpoint at ``model``."""
        decoders = {m.modality: m.wire_decoder(model) for m in self.modalities}
        return {modality: decoder for modality, decoder in decoders.items() if decoder is not None}

    def decode_wire(
        self,
        tensors: Mapping[str, Any],
        decoders: Mapping[str, WireDecoder],
        *,
        item_ids: dict[str, list[str]] | None = None,
    ) -> dict[str, Any]:
        """``tensors`` (a request's, or ``preprocess``'s outputs) with the wire fields turned back
        into the fields they stand for (``decoders``: ``wire_decoders``): what the HF processor
        itself outputs. Empty wire fields are dropped, and so are a modality's empty tensors where
        its wire fields are not. ``item_ids``, if given, gets per decoded modality the identities
        of its items (``ModalitySpec.wire_item_ids``), where the modality has them."""
        out = dict(tensors)
        for modality in self.modalities:
            wire = {name: out.pop(name) for name in modality.wire_field_names if name in out}
            if not any(numel(value) for value in wire.values()):
                continue
            decoder = decoders.get(modality.modality)
            if decoder is None:
                raise ProcessedInputError(
                    modality.modality,
                    field=",".join(sorted(wire)),
                    expected=f"the fields {sorted(modality.field_names)} (no decoder for this checkpoint)",
                    found="wire fields",
                )
            own = {name: out.pop(name) for name in modality.field_names if name in out}
            own = {name: value for name, value in {**own, **wire}.items() if numel(value)}
            out.update(decoder(own))
            if item_ids is not None and (ids := modality.wire_item_ids(own)) is not None:
                item_ids[modality.modality] = ids
        return out

    @property
    def hf_overrides(self) -> dict[str, list[str]]:
        return {"architectures": [self.passthrough_architecture]}


MAX_PIXEL_VALUE = 64.0
"""The largest magnitude of a normalized pixel the vision towers take. Every processor served here
rescales 8-bit pixels and normalizes them per channel: CLIP's mean and std (Qwen2-VL, Qwen2.5-VL,
Qwen2.5-Omni) give values within [-1.8, 2.2], ImageNet's (InternVL) within [-2.2, 2.7], Qwen3-VL's 0.5
and 0.5 within [-1, 1]. Far larger finite values overflow a tower's float32 arithmetic: one value of
1e30 in ``pixel_values_videos`` made the Qwen3-VL tower's output NaN (its LayerNorm's variance), and
those NaN keys and values in vLLM's CPU KV cache made the next, unrelated request answer token 0
(found by ``tests/test_property_engine.py``); half-precision deployments overflow far sooner."""


def hidden_size(hf_config: PretrainedConfig) -> int:
    """The language model's hidden size: the width of every embedding merged into the prompt."""
    return int(hf_config.get_text_config().hidden_size)


def check_embeddings(
    modality: str,
    field: str,
    embeds: Any,
    rows: int,
    hf_config: PretrainedConfig,
    rule: str,
    width: tuple[int, str] | None = None,
) -> None:
    """An encoder's output sent in place of its input (encoder offload): ``rows`` rows (one per
    placeholder token, by ``rule``) of ``width`` values (default: the LLM's hidden size)."""
    hidden, meaning = width or (hidden_size(hf_config), "the language model's hidden size")
    if embeds.shape[1] != hidden:
        raise ProcessedInputError(
            modality,
            field=field,
            expected=f"{hidden} values per row ({meaning})",
            found=f"shape {tuple(embeds.shape)}",
        )
    if embeds.shape[0] != rows:
        raise ProcessedInputError(
            modality,
            field=field,
            expected=f"{rows} rows (one per placeholder token: {rule})",
            found=f"{embeds.shape[0]} rows",
        )
    if embeds.numel() and (found := beyond(embeds, MAX_EMBEDDING_VALUE)):
        raise ProcessedInputError(
            modality,
            field=field,
            expected=f"values within [-{MAX_EMBEDDING_VALUE:g}, {MAX_EMBEDDING_VALUE:g}] (float16's range)",
            found=f"{found[0]} value(s) beyond, up to {found[1]:g} in magnitude",
        )


MAX_EMBEDDING_VALUE = 65504.0
"""The largest magnitude of an encoder's output sent in place of its input: float16's largest value,
far beyond what a tower's output holds (the tiny checkpoints' stay within a few units). The bound
keeps a client's finite but huge values (1e30) out of the language model's float32 norms, whose
squares would overflow, as ``MAX_PIXEL_VALUE`` and ``MAX_LOG_MEL`` bound the features."""


def check_pixel_magnitude(modality: str, field: str, pixels: torch.Tensor) -> None:
    """``pixels`` (normalized) within ``MAX_PIXEL_VALUE``; raise ``ProcessedInputError``."""
    if pixels.numel() and (found := beyond(pixels, MAX_PIXEL_VALUE)):
        raise ProcessedInputError(
            modality,
            field=field,
            expected=f"normalized pixel values within [-{MAX_PIXEL_VALUE:g}, {MAX_PIXEL_VALUE:g}] (a processor's "
            "normalization of 8-bit pixels: within [-2.2, 2.7] for every checkpoint served here)",
            found=f"{found[0]} value(s) beyond, up to {found[1]:g} in magnitude",
        )


def beyond(tensor: torch.Tensor, bound: float) -> tuple[int, float] | None:
    """(how many, the largest magnitude) of a float tensor's values beyond ``bound`` in magnitude,
    or None. Through NumPy where it can (one pass; see ``non_finite_count``)."""
    import torch

    if tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64, torch.float16):
        array = np.abs(tensor.detach().numpy())
    else:
        array = tensor.detach().abs().float().cpu().numpy()
    peak = float(array.max())
    if peak <= bound:
        return None
    return int(np.count_nonzero(array > bound)), peak


def _beyond_float32_count(tensor: torch.Tensor) -> int:
    """How many values of a finite float64 tensor float32 can't hold (they would be Inf in it)."""
    array = tensor.detach().cpu().numpy()
    return int(np.count_nonzero(np.abs(array) > np.finfo(np.float32).max))


@functools.cache
def _integer_dtypes() -> frozenset[torch.dtype]:
    """The integer dtypes a field may come in: those every operation on it, here and in the engine
    (sums, products, comparisons, indexing), has kernels for. torch's uint16/32/64 lack most (a
    ``prod`` of a uint64 grid raises inside vLLM's processor), so they are refused."""
    import torch

    return frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})


def as_tensor(value: Any, modality: str, field: str) -> torch.Tensor:
    """Accept torch tensors and numpy arrays of numbers (what Triton hands over)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        try:
            return torch.from_numpy(np.ascontiguousarray(value))
        except TypeError:  # object, string, datetime, ... arrays: no tensor of them
            raise ProcessedInputError(
                modality, field=field, expected="a numeric array", found=f"dtype {value.dtype}"
            ) from None
    raise ProcessedInputError(
        modality, field=field, expected="a torch.Tensor or numpy.ndarray", found=type(value).__name__
    )


def numel(value: Any) -> int:
    """Elements of a tensor, an array or a sequence (0 for None)."""
    if value is None:
        return 0
    size = getattr(value, "numel", None)
    if callable(size):
        return int(size())
    return int(getattr(value, "size", len(value)))

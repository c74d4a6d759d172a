"""The tensors that travel between ``preprocess`` and ``mm_llm`` (and from clients that preprocess on
their side straight to ``mm_llm``): the HF processor's own names, native dtypes and shapes.

The feature tensors are the union of the families' fields and wire fields (``mmserve.families``:
e.g. ``pixel_values_uint8``, which ``preprocess`` sends in place of ``pixel_values``), so the
families stay the one place that knows them. ``preprocess`` outputs only the feature tensors of the
modalities a request has (a text request: ``input_ids`` alone), and ``encode`` only the embeddings it
computed: Triton's ensemble hands the next step a missing output as an absent optional input (Triton
>= 2.42, core#298), and every tensor left out is one less to allocate, copy and parse on each hop
(``docs/PERFORMANCE.md``).
The request and response tensors around them are in ``mmserve.wire`` (which the client imports
without torch); ``MM_LLM_INPUTS`` puts the two together. ``tests/test_serving.py`` checks the model
repository's config.pbtxt files against this module.
"""

from __future__ import annotations

from mmserve.families import FAMILIES, FieldSpec
from mmserve.wire import CANCEL, DRAIN, GENERATION_INPUTS, LORA_ADAPTERS, OPERATOR_KEY, TEXT_INPUT

INPUT_IDS = FieldSpec(
    "input_ids",
    "int64",
    ("tokens",),
    "prompt token ids, chat template applied, every media placeholder already expanded",
)


def _tensors(*, encoded: bool) -> tuple[FieldSpec, ...]:
    fields: dict[str, FieldSpec] = {}
    for family in FAMILIES.values():
        for modality in family.specs:
            for spec in (*modality.fields, *modality.wire_fields):
                known = fields.setdefault(spec.name, spec)
                if (known.dtype, known.triton_dims) != (spec.dtype, spec.triton_dims):
                    raise ValueError(f"{spec.name}: families disagree on its dtype or dims")
    features = {
        name for family in FAMILIES.values() for m in family.modalities for name in m.field_names | m.wire_field_names
    }
    return tuple(spec for name, spec in fields.items() if (name in features) != encoded)


FEATURE_TENSORS: tuple[FieldSpec, ...] = _tensors(encoded=False)
"""What ``preprocess`` outputs: the HF processor's tensors (and the families' wire fields)."""
ENCODED_TENSORS: tuple[FieldSpec, ...] = _tensors(encoded=True)
"""The encoders' outputs that ``mm_llm`` takes in place of some of ``FEATURE_TENSORS`` (the
families' ``encoded`` forms: ``image_embeds``, ...), which the ``encode`` model outputs."""


MM_LLM_INPUTS: tuple[FieldSpec, ...] = (
    INPUT_IDS,
    *FEATURE_TENSORS,
    *ENCODED_TENSORS,
    TEXT_INPUT,
    *GENERATION_INPUTS,
    CANCEL,
    DRAIN,
    LORA_ADAPTERS,
    OPERATOR_KEY,
)
"""What ``mm_llm`` takes, in its config.pbtxt's order: only ``input_ids`` is required."""

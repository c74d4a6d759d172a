"""The worked example of docs/adding-a-family.md (examples/custom_family.py) on real tensors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mmserve.errors import ProcessedInputError
from mmserve.passthrough.items import ProcessedItems

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_family.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_family", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_masked_audio_items_and_counts(example):
    audio = example.MY_OMNI.modality("audio")
    masks = torch.zeros(2, 50, dtype=torch.int64)
    masks[0, :20] = 1
    masks[1, :35] = 1
    items = ProcessedItems({"audio_values": torch.randn(2, 80, 100), "audio_attention_masks": masks}, audio, None)
    assert len(items) == 2
    assert items.expected_tokens() == [20, 35]
    assert items.get(1)["audio_values"].shape == (80, 100)
    assert items.describe() == ["20 unmasked positions", "35 unmasked positions"]


def test_masked_audio_errors_name_item_and_field(example):
    audio = example.MY_OMNI.modality("audio")
    masks = torch.ones(2, 50, dtype=torch.int64)
    masks[1] = 0
    with pytest.raises(ProcessedInputError, match=r"audio item 1, audio_attention_masks: expected at least one"):
        ProcessedItems({"audio_values": torch.randn(2, 80, 100), "audio_attention_masks": masks}, audio, None)
    with pytest.raises(ProcessedInputError, match=r"audio, audio_values: expected a floating-point tensor"):
        ProcessedItems(
            {"audio_values": torch.ones(2, 80, 100, dtype=torch.int64), "audio_attention_masks": masks}, audio, None
        )


def test_family_reuses_the_qwen_vision_rule(example):
    assert [m.modality for m in example.MY_OMNI.modalities] == ["image", "audio"]
    assert example.MY_OMNI.hf_overrides == {"architectures": ["MyOmniPassthrough"]}

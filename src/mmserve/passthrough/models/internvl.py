"""InternVL's fix of vLLM 0.32's model class (``InternS1ForConditionalGeneration``): the encoder's
output as the project's encoded form."""

from __future__ import annotations

from typing import Any


class InternVLEmbeddings:
    """InternVL fed its vision tower's output as the project's encoded form (``image_embeds`` of all
    images, rows in order, with ``image_num_patches``): split per image, ``image_seq_length`` rows
    per tile. vLLM 0.32 takes ``image_embeds`` as one tensor per image, (images, rows, hidden), and
    checks that shape before anything else; its own form (``--enable-mm-embeds``) is left as it is.
    Ends with a vLLM release that takes a family's embeddings of all items in one tensor with their
    counts (no upstream issue asks for it: the project's form, docs/upstream-vllm.md)."""

    def _parse_and_validate_image_input(self, **kwargs: object) -> Any:
        embeds, tiles = kwargs.get("image_embeds"), kwargs.get("image_num_patches")
        if embeds is None or tiles is None or isinstance(embeds, list):
            return super()._parse_and_validate_image_input(**kwargs)  # type: ignore[misc]
        per_tile = int(self.config.image_seq_length)  # type: ignore[attr-defined]
        rows = [int(n) * per_tile for n in tiles.reshape(-1).tolist()]  # type: ignore[attr-defined]
        return {"type": "image_embeds", "data": embeds.split(rows)}  # type: ignore[attr-defined]

"""The ``encode`` model's logic (``model_repository_encoder/encode``): ``preprocess``'s feature
tensors in, the encoders' outputs out (``mmserve.encoder.Encoder``: the checkpoint's towers alone,
an LRU cache of embeddings), with the cache's hits and misses as Triton metrics.

Parameters (config.pbtxt, strings; an absent or empty value keeps the default): ``engine_config``
(the engine's ``model.json``, whose ``model`` is the checkpoint; ``MMSERVE_MODEL`` overrides it),
``device`` (``cpu``, ``cuda``, ``cuda:1``; default ``cuda`` where torch sees one, else ``cpu``),
``dtype`` (``float32``, ``bfloat16``, ``float16``; default ``float32``: the engine's own on this
project's CPU setup), ``cache_bytes`` (268435456; 0: no cache).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.encoder import MODALITIES, Encoder, Towers
from mmserve.errors import InputError
from mmserve.serving.contract import FEATURE_TENSORS

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EncodeSettings:
    device: str
    dtype: str
    cache_bytes: int

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> EncodeSettings:
        import torch

        device = params.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = params.get("dtype") or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"parameter dtype: expected one of {list(DTYPES)}, found {dtype!r}")
        raw = params.get("cache_bytes") or str(256 << 20)
        if not raw.isdigit():
            raise ValueError(f"parameter cache_bytes: expected a number of bytes (0: no cache), found {raw!r}")
        return cls(device, dtype, int(raw))


class EncodeService:
    """One ``encode`` instance: the towers on ``settings.device``, the cache, the metrics' deltas."""

    def __init__(self, model: str, settings: EncodeSettings) -> None:
        import torch

        towers = Towers(model, device=settings.device, dtype=getattr(torch, settings.dtype))
        self.encoder = Encoder(towers, cache_bytes=settings.cache_bytes)
        self._reported = (dict(self.encoder.stats.hits), dict(self.encoder.stats.misses))

    def __call__(self, get: Callable[[str], np.ndarray | None]) -> dict[str, np.ndarray]:
        tensors = {}
        for spec in FEATURE_TENSORS:
            value = get(spec.name)
            if value is not None and value.size:
                tensors[spec.name] = value
        import torch

        try:
            outputs = self.encoder(tensors)
        except torch.OutOfMemoryError:
            raise  # the device's, not the request's: answered INTERNAL
        except (ValueError, IndexError, RuntimeError) as exc:
            # a shape the towers can't take (preprocess's own outputs always fit: a direct caller's)
            raise InputError(f"encode: the feature tensors do not fit the encoders ({exc})") from exc
        return {name: value for name, value in outputs.items() if value.size}  # none for no items

    def stats_delta(self) -> dict[str, tuple[int, int]]:
        """Per modality, (hits, misses) since the last call."""
        hits, misses = self.encoder.stats.hits, self.encoder.stats.misses
        old_hits, old_misses = self._reported
        delta = {m: (hits[m] - old_hits[m], misses[m] - old_misses[m]) for m in MODALITIES}
        self._reported = (dict(hits), dict(misses))
        return delta


class CacheMetrics:
    """``mmserve_encoder_cache_hits_total`` and ``..._misses_total`` (items, by modality) and
    ``mmserve_encoder_cache_bytes`` on Triton's ``/metrics``."""

    def __init__(self, pb_utils: Any, labels: Mapping[str, str]) -> None:
        family = pb_utils.MetricFamily
        # A MetricFamily must outlive its Metric objects (Triton refuses updates otherwise).
        self._hits = family(
            name="mmserve_encoder_cache_hits_total",
            description="Items whose embeddings were cached.",
            kind=family.COUNTER,
        )
        self._misses = family(
            name="mmserve_encoder_cache_misses_total", description="Items encoded.", kind=family.COUNTER
        )
        self._bytes = family(
            name="mmserve_encoder_cache_bytes", description="Bytes of embeddings cached.", kind=family.GAUGE
        )
        self.hits = {m: self._hits.Metric(labels={**labels, "modality": m}) for m in MODALITIES}
        self.misses = {m: self._misses.Metric(labels={**labels, "modality": m}) for m in MODALITIES}
        self.bytes = self._bytes.Metric(labels=dict(labels))
        # Never deleted: other instances of the model share them (mmserve.triton_seam SHARED_METRIC_FAMILIES).
        from mmserve.serving.embedded import never_free

        never_free(self._hits, self._misses, self._bytes, *self.hits.values(), *self.misses.values(), self.bytes)

    def update(self, service: EncodeService) -> None:
        for modality, (hits, misses) in service.stats_delta().items():
            if hits:
                self.hits[modality].increment(hits)
            if misses:
                self.misses[modality].increment(misses)
        self.bytes.set(service.encoder.stats.bytes)

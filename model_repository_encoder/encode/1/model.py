"""encode: preprocess's feature tensors -> the encoders' outputs (Triton adapter).

Inputs : the feature tensors preprocess outputs (pixel_values_uint8 or pixel_values, image_grid_thw,
         input_features, feature_attention_mask, pixel_values_videos, video_grid_thw; all optional:
         only those of the media the request has).
Outputs: image_embeds, video_embeds, audio_embeds (FP32 [rows, hidden]: one row per placeholder
         token), audio_feature_lengths (INT64 [clips]); none for a modality without items.

Only the checkpoint's vision and audio towers are loaded (mmserve.encoder.Towers), on the
``device`` parameter; embeddings are cached per item (LRU, ``cache_bytes``), with
mmserve_encoder_cache_* metrics. The logic lives in mmserve.serving.encode; see docs/ARCHITECTURE.md.
"""

import functools
import json
import os

from mmserve.serving.embedded import arm_deadman_switch, finish_stub, freeze_startup_heap, prepare_stub, use_utf8_locale

use_utf8_locale()  # first: before torch reads a file (see its docstring)

import triton_python_backend_utils as pb_utils

from mmserve.inputs import read_engine_config
from mmserve.serving.encode import CacheMetrics, EncodeService, EncodeSettings
from mmserve.serving.triton import error_response, parameters, read_input


class TritonPythonModel:
    def initialize(self, args):
        prepare_stub(pb_utils)
        model_config = json.loads(args["model_config"])
        config = parameters(model_config)
        engine = read_engine_config(os.path.join(args["model_repository"], config.get("engine_config") or ""))
        self.service = EncodeService(engine["model"], EncodeSettings.from_parameters(config))
        self.metrics = CacheMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        freeze_startup_heap()
        arm_deadman_switch()

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = self.service(functools.partial(read_input, pb_utils, request))
                tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:
                responses.append(error_response(pb_utils, exc, context="encode"))
        self.metrics.update(self.service)
        return responses

    def finalize(self):
        finish_stub()

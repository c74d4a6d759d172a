"""preprocess: one raw request -> the model's HF processor output (Triton adapter).

Inputs : text_input (BYTES [1], UTF-8), or messages (BYTES [1], a conversation as UTF-8 JSON);
         optional image (BYTES [n], encoded files or data URLs), audio (BYTES [n], encoded files or
         data URLs), audio_pcm (FP32 [samples], one mono clip) with audio_sample_rate (INT32 [1]),
         apply_chat_template (BOOL [1], default true; not false with messages), video (BYTES [n]),
         tools (BYTES [1], with messages: the function tools for the chat template, JSON).
Outputs: input_ids (INT64 [tokens], placeholders expanded), pixel_values, image_grid_thw,
         input_features, feature_attention_mask (only those of the media the request has).

Parameters (config.pbtxt, all strings): ``engine_config`` (the engine's ``model.json``, relative to
this model's folder: its ``model`` is the checkpoint whose processor runs here, so the checkpoint is
configured once; ``MMSERVE_MODEL`` overrides it for both); the request limits ``max_request_bytes``
(64 MiB), ``max_images`` and ``max_audio_clips`` (default and ceiling: the engine's
``limit_mm_per_prompt``), ``max_image_pixels`` (16777216), ``max_audio_seconds`` (empty or ``window``: the model's audio
window, 30 s for Whisper-style encoders), ``max_total_audio_seconds`` (60), ``max_prompt_tokens``
(32768), ``max_messages`` (64); ``user_control_tokens`` (``escape``, the default, or ``reject``: special tokens typed in
the user's text); ``torch_threads`` (``auto``: the cores this process may use, shared out among
the model's instances; or a number). An absent or empty value keeps the default; a bad one fails the
model's loading.

Errors: every exception is answered, through ``mmserve.errors.public_error`` (by
``mmserve.serving.triton.error_response``, which also tags the message with its code): a rejected
request (``mmserve.errors.InputError``, e.g. ``image[1]: 100000000 pixels (10000x10000) exceeds the
limit of 16777216 (max_image_pixels)``) as INVALID_ARG with its message; anything else as INTERNAL
with an incident id only (the traceback goes to the server log, never to the client).
The logic lives in mmserve.serving.preprocess; see docs/tensors.md.
"""

import functools
import json
import logging
import os
from typing import cast

from mmserve.serving.embedded import arm_deadman_switch, finish_stub, freeze_startup_heap, prepare_stub, use_utf8_locale

use_utf8_locale()  # first: before torch or vLLM read a file (see its docstring)

import torch
import triton_python_backend_utils as pb_utils

from mmserve.inputs import mm_limits, read_engine_config
from mmserve.serving.preprocess import (
    ControlTokenPolicy,
    PreprocessLimits,
    Preprocessor,
    parse_preprocess_request,
    threads_per_instance,
)
from mmserve.serving.triton import error_response, parameters, read_input

logger = logging.getLogger("preprocess")


class TritonPythonModel:
    def initialize(self, args):
        prepare_stub(pb_utils)
        model_config = json.loads(args["model_config"])
        config = parameters(model_config)
        instances = sum(group.get("count", 1) for group in model_config.get("instance_group", [])) or 1
        threads = threads_per_instance(config.get("torch_threads"), instances)
        torch.set_num_threads(threads)
        logger.info(
            "%s: %d torch thread(s) per instance, %d instance(s)",
            args.get("model_instance_name", "preprocess"),
            threads,
            instances,
        )
        engine = read_engine_config(os.path.join(args["model_repository"], config.get("engine_config") or ""))
        self.preprocessor = Preprocessor(
            engine["model"],
            limits=PreprocessLimits.from_parameters(config, mm_limits(engine)),
            # the parameter's text: Preprocessor refuses any other value with a precise error
            user_control_tokens=cast(ControlTokenPolicy, config.get("user_control_tokens") or "escape"),
        )
        freeze_startup_heap()
        arm_deadman_switch()

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = self._preprocess(request)
                tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:
                responses.append(error_response(pb_utils, exc, context="preprocess"))
        return responses

    def finalize(self):
        finish_stub()

    def _preprocess(self, request):
        parsed = parse_preprocess_request(functools.partial(read_input, pb_utils, request))
        return self.preprocessor(**parsed.kwargs())

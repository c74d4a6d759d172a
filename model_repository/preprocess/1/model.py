"""preprocess: one raw request -> the model's HF processor output (Triton adapter).

Inputs : text_input (BYTES [1]); optional image (BYTES [n], encoded files or data URLs),
         audio (BYTES [n], encoded files or data URLs), audio_pcm (FP32 [samples], one mono clip)
         with audio_sample_rate (INT32 [1]), apply_chat_template (BOOL [1], default true).
Outputs: input_ids (INT64 [tokens], placeholders expanded), pixel_values, image_grid_thw,
         input_features, feature_attention_mask (empty when the request has no such media).
The logic lives in mmserve.serving.preprocess; see docs/tensors.md.
"""

import json

import triton_python_backend_utils as pb_utils

from mmserve.inputs import resolve_model
from mmserve.serving.preprocess import PreprocessError, Preprocessor


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        configured = config.get("parameters", {}).get("model", {}).get("string_value")
        self.preprocessor = Preprocessor(resolve_model(configured, args["model_repository"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = self._preprocess(request)
            except PreprocessError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def _preprocess(self, request):
        text = _input(request, "text_input")
        if text is None or text.size != 1:
            raise PreprocessError("text_input: expected exactly one prompt string")
        pcm = _input(request, "audio_pcm")
        clips = []
        if pcm is not None and pcm.size:
            rate = _input(request, "audio_sample_rate")
            if rate is None or rate.size != 1:
                raise PreprocessError("audio_sample_rate: required (INT32 [1]) with audio_pcm")
            clips.append((pcm.reshape(-1), int(rate.reshape(-1)[0])))
        template = _input(request, "apply_chat_template")
        return self.preprocessor(
            text.reshape(-1)[0].decode("utf-8"),
            images=_items(_input(request, "image")),
            audios=_items(_input(request, "audio")),
            pcm=clips,
            apply_chat_template=True if template is None or template.size == 0 else bool(template.reshape(-1)[0]),
        )


def _items(array):
    return [] if array is None else list(array.reshape(-1))

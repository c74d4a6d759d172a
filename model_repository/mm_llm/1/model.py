"""mm_llm: vLLM (V1 AsyncLLM) on already-processed multimodal tensors (Triton adapter, decoupled).

Inputs : input_ids (INT64 [tokens], placeholders expanded); optional pixel_values, image_grid_thw,
         input_features, feature_attention_mask (the HF processor's outputs, empty when absent),
         text_input (echoed unless exclude_input_in_output), stream, sampling_parameters (JSON),
         exclude_input_in_output and the return_* flags of Triton's vLLM backend.
Outputs: text_output, output_ids, and when asked finish_reason, cumulative_logprob, logprobs,
         num_input_tokens, num_output_tokens. One response per delta when streaming.
Engine arguments come from model.json beside config.pbtxt. The logic lives in mmserve.serving.llm;
see docs/tensors.md.
"""

import functools
import json
import os

import triton_python_backend_utils as pb_utils

from mmserve.serving.llm import LLMConfig, LLMService, RequestError, parse_request
from mmserve.serving.metrics import TritonMetrics, TritonStatLogger

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Sink:
    """One request's response sender, as mmserve.serving.llm.ResponseSink."""

    def __init__(self, request):
        self._sender = request.get_response_sender()

    def send(self, outputs, *, final):
        tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
        self._sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=_FINAL if final else 0)

    def send_error(self, message, *, client_error):
        code = pb_utils.TritonError.INVALID_ARG if client_error else pb_utils.TritonError.INTERNAL
        self._sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=_FINAL)

    def send_final(self):
        self._sender.send(flags=_FINAL)

    def is_cancelled(self):
        return self._sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("mm_llm must be decoupled (model_transaction_policy)")
        config = LLMConfig.from_file(os.path.join(args["model_repository"], "model.json"))
        self.metrics = TritonMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        self.service = LLMService.start(config, stat_loggers=[functools.partial(TritonStatLogger, metrics=self.metrics)])
        self.family = self.service.family

    def execute(self, requests):
        for request in requests:
            sink = _Sink(request)
            try:
                parsed = parse_request(self.family, functools.partial(_input, request))
            except RequestError as exc:
                sink.send_error(str(exc), client_error=True)
                continue
            # Triton request ids need not be unique; the engine's must be.
            request_id = self.service.runner.new_request_id(request.request_id() or "triton")
            self.service.submit(parsed, sink, request_id)
        return None

    def finalize(self):
        self.service.shutdown()  # in-flight requests finish; then no stats arrive any more
        self.metrics.close()


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()

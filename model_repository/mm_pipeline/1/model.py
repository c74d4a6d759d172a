"""mm_pipeline: preprocess -> mm_llm through BLS, with the tensors of mm_ensemble, and the client's
cancellation carried to the engine (Triton's ensemble scheduler can't: see mmserve.serving.pipeline).

Inputs and outputs: those of mm_ensemble (docs/tensors.md). Decoupled: streams when `stream` is true.
The logic lives in mmserve.serving.pipeline.
"""

import gc
import json

import triton_python_backend_utils as pb_utils

from mmserve.serving.embedded import exit_soon_after_finalize, use_utf8_locale

use_utf8_locale()  # first: before torch or vLLM read a file (see its docstring)

from mmserve.serving.pipeline import Pipeline


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("mm_pipeline must be decoupled (model_transaction_policy)")
        self.pipeline = Pipeline(pb_utils)

    def execute(self, requests):
        for request in requests:
            self.pipeline.submit(request)
        return None

    def finalize(self):
        self.pipeline.shutdown()
        # Now, while the stub can still free them: response senders held in reference cycles (an
        # exception's traceback) freed at interpreter exit crash the stub (Triton 2.51).
        gc.collect()
        exit_soon_after_finalize()  # a stub that hangs on its way out would block the server's stop

"""What the Triton adapters (``model_repository/*/1/model.py``) share: errors as Triton errors,
config ``parameters``, input tensors. ``pb_utils`` (``triton_python_backend_utils``) exists only in
the Python-backend stub, so it is passed in.

Error codes and what clients see on Triton 2.51: the models send the taxonomy's code
(``mmserve.errors``), but that release drops it on the two paths decoupled models answer on: gRPC
stream responses carry only a message, and the HTTP generate endpoints answer 400 for any model
error (later releases map codes to statuses). So every message also starts with its code in
brackets, ``[UNAVAILABLE] the engine failed ...``: the one part of the status that reaches every
client; ``mmserve.client`` turns it back into an exception class.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from mmserve.errors import public_error
from mmserve.wire import tagged

logger = logging.getLogger(__name__)


def triton_error(pb_utils: Any, exc: BaseException, *, context: str = "") -> Any:
    """``exc`` as a ``pb_utils.TritonError`` fit for the client (see ``mmserve.errors.public_error``)."""
    error = public_error(exc, context=context)
    return pb_utils.TritonError(tagged(error.triton_code, str(error)),
                                getattr(pb_utils.TritonError, error.triton_code))


def error_response(pb_utils: Any, exc: BaseException, *, context: str = "") -> Any:
    return pb_utils.InferenceResponse(error=triton_error(pb_utils, exc, context=context))


def parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The model's config.pbtxt ``parameters`` as plain strings."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


def read_input(pb_utils: Any, request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()

"""An OpenAI-compatible chat API in front of the Triton models: ``/v1/chat/completions`` (streamed or
not; text, image and audio parts), ``/v1/models``, ``/health``.

Run it beside tritonserver (``scripts/serve.sh`` does) or against any Triton gRPC endpoint::

    python -m mmserve.gateway --triton-url 127.0.0.1:8001 --host 127.0.0.1 --port 9000

Modules: ``protocol`` (the request's pydantic models, what is accepted and refused), ``convert``
(request -> the Triton tensors, the ``messages`` conversation; media counted against the limits
first; logprobs back), ``media`` (remote media, when allowed: public addresses only, checked on the
address each connection is made to), ``triton`` (one shared gRPC stream for every request, responses
told apart by id), ``errors`` (OpenAI's error shape and statuses), ``app`` (the FastAPI app; the
optional API key, as ``vllm serve --api-key``), ``__main__`` (the CLI).
Importing it loads no web framework: ``create_app`` and ``GatewayConfig`` come from ``app``.
"""

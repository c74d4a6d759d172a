"""The logic behind the Triton models in ``model_repository/`` (their ``model.py`` files only adapt
Triton tensors and responses to it): the tensor contract, preprocessing, the engine service and its
metrics."""

"""Model loading: GGUF metadata, architecture config, tokenizer, the executor
interface, and `load_model`, which puts them together with an engine."""

from lockgate.models.loading import (
    Model, ModelSource, ModelSpec, load_model, load_model_from_settings, load_served_model, open_model,
)

__all__ = [
    "Model", "ModelSource", "ModelSpec", "load_model", "load_model_from_settings", "load_served_model",
    "open_model",
]

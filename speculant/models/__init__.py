"""Loading models (Hugging Face folders, GGUF files, the embedded default) and their KV state."""
from .kv import KVState
from .loading import LoadedModel, load_model, resolve_device, resolve_dtype

__all__ = ["KVState", "LoadedModel", "load_model", "resolve_device", "resolve_dtype"]

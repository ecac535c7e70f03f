"""speculant: lossless speculative decoding for Hugging Face causal language models."""
from . import api
from .api import Generator, Output, generate
from .errors import SpeculantError
from .sampling import SamplingParams
from .tools.loader import load
from .version import __version__

api.load = load  # speculant.api.load, as before: api sits below the loader, which builds a Generator

__all__ = ["load", "generate", "Generator", "Output", "SamplingParams", "SpeculantError", "__version__"]

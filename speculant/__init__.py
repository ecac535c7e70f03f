"""speculant: lossless speculative decoding for Hugging Face causal language models."""
from .api import Generator, Output, generate, load
from .errors import SpeculantError
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["load", "generate", "Generator", "Output", "SamplingParams", "SpeculantError", "__version__"]

"""Other CPU runtimes on the same GGUF file, side by side with speculant in one bench process.

Used when installed and the target is a ``.gguf`` file (neither is a dependency: ``llama-cpp-python``
compiles from source for ~25 minutes on 2 cores; ``openvino-genai`` is a pip wheel):

- ``llama.cpp`` (llama-cpp-python), plain, and with its prompt-lookup drafter
  (``LlamaPromptLookupDecoding``, 10 tokens: its documented choice);
- ``openvino`` (OpenVINO GenAI's ``LLMPipeline``, which reads the GGUF itself), plain, and with its
  prompt lookup (``prompt_lookup=True``, 5 assistant tokens, n-grams up to 3).

Each gets the very prompt token ids speculant gets (our tokenizer and chat template), greedy, the
torch thread count, and stops at the target's end-of-text ids or ``max_new_tokens``. Their text is
compared with HF ``generate``'s for information only: they re-quantize or round otherwise, which is
what speculant's exactness is measured against.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

PEERS = ("llama.cpp", "openvino")
MODES = {"llama.cpp": ("llama.cpp", "llama.cpp prompt lookup"), "openvino": ("openvino", "openvino prompt lookup")}
_MODULES = {"llama.cpp": "llama_cpp", "openvino": "openvino_genai"}


def installed() -> list[str]:
    return [p for p in PEERS if importlib.util.find_spec(_MODULES[p]) is not None]


def method_names(peers: list[str]) -> list[str]:
    return [name for p in peers for name in MODES[p]]


class LlamaCpp:
    def __init__(self, gguf: Path, context: int, lookup: bool):
        from llama_cpp import Llama

        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
        threads = torch.get_num_threads()
        self.llm = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         draft_model=draft, verbose=False)

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
        out: list[int] = []
        self.llm.reset()  # generate() would reuse the cache of a prompt sharing a prefix with the last one
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in eos or len(out) >= max_new_tokens:
                break
        return out


class OpenVino:
    def __init__(self, gguf: Path, lookup: bool):
        import openvino_genai as ov_genai

        self.ov_genai = ov_genai
        extra = {"prompt_lookup": True} if lookup else {}
        self.pipe = ov_genai.LLMPipeline(str(gguf), "CPU", INFERENCE_NUM_THREADS=torch.get_num_threads(), **extra)
        self.lookup = lookup

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
        import numpy as np
        import openvino as ov

        cfg = self.ov_genai.GenerationConfig()
        cfg.max_new_tokens, cfg.do_sample = max_new_tokens, False
        cfg.stop_token_ids = set(eos)
        if self.lookup:
            cfg.num_assistant_tokens, cfg.max_ngram_size = 5, 3
        x = np.array([ids], dtype=np.int64)
        res = self.pipe.generate(self.ov_genai.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x))), cfg)
        out = [int(t) for t in res.tokens[0]][:max_new_tokens]
        cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        return out[:cut]


def load(name: str, gguf: Path, context: int):
    """The runner of one peer method (a name of ``method_names``)."""
    lookup = name.endswith("prompt lookup")
    if name.startswith("llama.cpp"):
        return LlamaCpp(gguf, context, lookup)
    return OpenVino(gguf, lookup)

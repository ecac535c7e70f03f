"""Other CPU runtimes on the same GGUF file, side by side with speculant in one bench process.

Used when installed and the target is a ``.gguf`` file (neither is a dependency: ``llama-cpp-python``
compiles from source for ~25 minutes on 2 cores; ``openvino-genai`` is a pip wheel):

- ``llama.cpp`` (llama-cpp-python), plain, and with its prompt-lookup drafter
  (``LlamaPromptLookupDecoding``, 10 tokens: its documented choice);
- ``openvino`` (OpenVINO GenAI's ``LLMPipeline``, which reads the GGUF itself), plain, and with its
  prompt lookup (``prompt_lookup=True``, 5 assistant tokens, n-grams up to 3);
- ``llama.cpp-draft``: llama.cpp's own draft-model speculation, its ``llama-speculative-simple``
  example (a binary built from the llama.cpp source llama-cpp-python vendors, with
  ``-DLLAMA_BUILD_EXAMPLES=ON``: docs/benchmarks.md; found on the PATH or at
  ``$SPECULANT_LLAMA_SPECULATIVE``), with the bench's first ``model:FILE.gguf`` drafter as its draft
  model, run once a prompt: its own reported times (the prompt's and the decoding's; the models'
  loading is not counted), its text tokenized back with the target's tokenizer.

Each gets the very prompt token ids speculant gets (our tokenizer and chat template), greedy, the
torch thread count, and stops at the target's end-of-text ids or ``max_new_tokens``. Their text is
compared with HF ``generate``'s for information only: they re-quantize or round otherwise, which is
what speculant's exactness is measured against.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import torch

PEERS = ("llama.cpp", "openvino", "llama.cpp-draft")
MODES = {"llama.cpp": ("llama.cpp", "llama.cpp prompt lookup"), "openvino": ("openvino", "openvino prompt lookup"),
         "llama.cpp-draft": ("llama.cpp draft model",)}
_MODULES = {"llama.cpp": "llama_cpp", "openvino": "openvino_genai"}
SPECULATIVE_ENV = "SPECULANT_LLAMA_SPECULATIVE"
# llama-speculative-simple's draft settings here: up to 8 drafts a pass (its default is 3; llama-server's
# 16 with p-min 0.75), no minimum probability: its fastest of those on the Qwen2.5-Coder pair
# (benchmarks/results/cpu-AVX512BF16-2026-12-07-zen5-real-pair/)
DRAFT_MAX, DRAFT_P_MIN = 8, 0.0


def speculative_binary() -> str | None:
    """llama.cpp's llama-speculative-simple: $SPECULANT_LLAMA_SPECULATIVE, else on the PATH."""
    given = os.environ.get(SPECULATIVE_ENV)
    if given:
        return given if Path(given).is_file() else None
    return shutil.which("llama-speculative-simple")


def installed() -> list[str]:
    found = [p for p in PEERS if p in _MODULES and importlib.util.find_spec(_MODULES[p]) is not None]
    return found + (["llama.cpp-draft"] if speculative_binary() else [])


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


class LlamaSpeculative:
    """llama.cpp's draft-model speculation (``llama-speculative-simple``), a process a prompt. ``seconds``
    after each ``generate``: the time it reports for the prompt and the decoding."""

    def __init__(self, gguf: Path, draft: Path, context: int, tokenizer):
        self.binary, self.gguf, self.draft, self.context, self.tokenizer = speculative_binary(), gguf, draft, context, tokenizer
        self.seconds: float | None = None
        self.stats: dict = {}

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
        threads = str(torch.get_num_threads())
        prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
        cmd = [self.binary, "-m", str(self.gguf), "-md", str(self.draft), "-p", prompt, "-n", str(max_new_tokens),
               "-c", str(min(self.context, len(ids) + max_new_tokens + 64)), "-t", threads, "-tb", threads,
               "--spec-type", "draft-simple", "--temp", "0", "--top-k", "1", "--spec-draft-n-max", str(DRAFT_MAX),
               "--spec-draft-p-min", str(DRAFT_P_MIN)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if run.returncode != 0:
            raise RuntimeError(f"llama-speculative-simple failed: {run.stderr.strip().splitlines()[-1:]}")
        log = run.stderr + run.stdout

        def number(pattern: str) -> float:
            m = re.search(pattern, log)
            return float(m.group(1)) if m else float("nan")

        encoded = number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds")
        decoded, made = number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds"), number(r"decoded\s+(\d+) tokens")
        text = run.stdout.split(prompt, 1)[-1] if prompt in run.stdout else run.stdout
        out = self.tokenizer(text.strip("\n"), add_special_tokens=False)["input_ids"][:max_new_tokens]
        # it may decode a pass's accepted drafts past -n: its time for the tokens counted here
        self.seconds = encoded + decoded * min(1.0, len(out) / made) if made == made and made > 0 else encoded + decoded
        self.stats = {"drafted": number(r"n_drafted = (\d+)"), "accepted": number(r"n_accept\s+= (\d+)")}
        cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        return out[:cut]


def load(name: str, gguf: Path, context: int, draft: Path | None = None, tokenizer=None):
    """The runner of one peer method (a name of ``method_names``); ``draft``: the draft model's GGUF
    (llama.cpp's own speculation)."""
    if name == "llama.cpp draft model":
        return LlamaSpeculative(gguf, draft, context, tokenizer)
    lookup = name.endswith("prompt lookup")
    if name.startswith("llama.cpp"):
        return LlamaCpp(gguf, context, lookup)
    return OpenVino(gguf, lookup)

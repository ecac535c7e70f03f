"""``dtype="auto"`` on a CPU: the dtype (and path) that decodes fastest on this machine, among those
that keep speculant's exactness promise, measured once and cached.

Candidates, each on the fast path where the architecture has one (else the general path), uncompiled:
- float32: greedy output token-identical to HF ``generate`` in float32;
- bfloat16: plain decoding bit-identical to HF ``generate`` in bfloat16 (speculative output may
  leave it at near-ties: a verify block rounds otherwise than one-token steps).

Which wins depends on the CPU: with oneDNN bf16 (AVX-512) bf16 streams half the bytes at full speed;
on AVX2-only CPUs bf16 decoding is fast (PyTorch's bf16 GEMV) but a bf16 prefill runs row by row,
so the measurement times a whole short request: a 48-token prompt and 32 new tokens.
The result is cached per machine (CPU model, ISA, torch version, threads, kernel choice) and model
in ``$SPECULANT_CACHE/cpu-choice.json``; delete the file (or pass a dtype) to choose again.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cpu_kernels
from .loading import _LOADED, cache_dir, load_model, resolve_model_path

CANDIDATES = ("float32", "bfloat16")
PROMPT_TOKENS, NEW_TOKENS = 48, 32


@dataclass
class Choice:
    dtype: str
    path: str  # "fast" or "general"
    ms_per_token: dict  # candidate dtype -> measured ms per new token (prefill included)
    cached: bool = False

    def describe(self) -> str:
        others = ", ".join(f"{d} {ms:.1f}" for d, ms in self.ms_per_token.items() if d != self.dtype)
        return (f"auto: {self.dtype} on the {self.path} path, {self.ms_per_token[self.dtype]:.1f} ms/token "
                f"(vs {others}; {'cached' if self.cached else 'measured now'})")


def machine_key() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return "|".join([cpu, cpu_kernels.cpu_capability(), torch.__version__, str(torch.get_num_threads()),
                     os.environ.get(cpu_kernels.ENV, "auto")])


def _model_key(spec: str) -> str:
    path = resolve_model_path(spec).resolve()
    st = path.stat() if path.is_file() else (path / "config.json").stat()
    return f"{path}|{st.st_size}|{int(st.st_mtime)}"


def _cache_file() -> Path:
    return cache_dir() / "cpu-choice.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def choose(spec: str, log=None) -> Choice:
    """The cached choice for this machine and model, or a new measurement (a few seconds, once)."""
    key = hashlib.sha256(f"{machine_key()}||{_model_key(spec)}".encode()).hexdigest()[:20]
    entry = _read_cache().get(key)
    if entry and entry.get("dtype") in CANDIDATES:
        return Choice(entry["dtype"], entry["path"], entry["ms_per_token"], cached=True)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    log("speculant: measuring which dtype decodes fastest on this CPU (once for this machine and model)")
    choice = measure(spec)
    log(f"speculant: {choice.describe()}; cached in {_cache_file()}")
    data = _read_cache()
    data[key] = {"dtype": choice.dtype, "path": choice.path, "ms_per_token": choice.ms_per_token,
                 "machine": machine_key(), "model": str(spec)}
    _cache_file().parent.mkdir(parents=True, exist_ok=True)
    tmp = _cache_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(_cache_file())
    return choice


def measure(spec: str, rounds: int = 2) -> Choice:
    """Time a short request with each candidate dtype, interleaved, and keep the fastest."""
    from ..drafters import NoDrafter
    from ..engine import Engine, Request
    from ..sampling import SamplingParams
    from .backend import Backend

    runs, path = {}, best_path(spec)
    for dtype in CANDIDATES:
        lm = load_model(spec, device="cpu", dtype=dtype)
        engine = Engine(lm.model, NoDrafter(), set(), lm.context_length, Backend(lm.model, path, quiet=True))
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, lm.vocab_size, (PROMPT_TOKENS,), generator=g).tolist()
        runs[dtype] = lambda e=engine, p=prompt: _request(e, Request([p], SamplingParams(), NEW_TOKENS, 0))
    best = {dtype: float("inf") for dtype in CANDIDATES}
    for dtype in CANDIDATES:  # warm-up (allocator, oneDNN primitives)
        runs[dtype]()
    for _ in range(rounds):
        for dtype in CANDIDATES:
            best[dtype] = min(best[dtype], runs[dtype]() / NEW_TOKENS * 1e3)
    winner = min(best, key=best.get)
    for key in [k for k in _LOADED if k[2] != getattr(torch, winner) and k[1] == "cpu"]:
        if key[0] == str(_folder_of(spec)):
            del _LOADED[key]  # the loser's weights are not kept
    return Choice(winner, path, {d: round(ms, 2) for d, ms in best.items()})


def best_path(spec: str) -> str:
    """The fast path where the architecture has one (faster on every CPU measured), else the general one."""
    from .fast import supports

    return "fast" if supports(load_model(spec, device="cpu", dtype="float32").model)[0] else "general"


def _folder_of(spec: str) -> Path:
    from .loading import resolve_model_folder

    return resolve_model_folder(spec)[0].resolve()


def _request(engine, req) -> float:
    t = time.perf_counter()
    it = engine.run(req)
    for _ in it:
        pass
    return time.perf_counter() - t

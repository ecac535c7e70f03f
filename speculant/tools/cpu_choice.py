"""``dtype="auto"`` on a CPU: the dtype (and path) that generates fastest on this machine with the
drafter that will run, among those that keep speculant's exactness promise, measured once and cached.

Candidates, each on the fast path where the architecture has one (else the general path), uncompiled:
- float32: speculative output bit-identical to plain decoding, which is HF ``generate``'s token for
  token in float32;
- bfloat16: speculative output bit-identical to plain decoding, which parts from HF ``generate``
  in bfloat16 only at rounding near-ties (width-invariant kernels: see ``models/invariant.py``);
- quantized (a .gguf target): float32 activations over the file's own quantized weights, speculative
  output bit-identical to plain decoding, which parts from HF ``generate`` on the dequantised model
  only at near-ties (``models/quantized.py``).

Which wins depends on the CPU and on the drafter. With oneDNN bf16 (AVX-512) bf16 streams half the
bytes at full speed, one-token steps and verify blocks alike. On AVX2-only CPUs bf16 one-token steps
are fast (PyTorch's bf16 GEMV) but verify blocks run on float32 copies of the weights (see
models/cpu_kernels.py) and the prefill, HF's own bf16 matmuls, runs a row at a time, so plain decoding of a
short prompt favours bf16 while speculative decoding and long prompts favour float32 (measured
on a 2-core AMD EPYC: float32 with the default drafter 14.9 tokens/s, bfloat16 12.7, plain bf16 12.2).
So the measurement times what will run: a real request of ~200 prompt tokens (the target's chat
template where it has one) with the drafter asked for, γ auto, each dtype warmed up first (the
engine learns its costs then). bfloat16 is kept only if it is at least 10% faster (``pick``).
The result is cached per machine (CPU model, ISA, torch version, threads, kernel choice), model and
drafter in ``$SPECULANT_CACHE/cpu-choice.json``; delete the file (or pass a dtype) to choose again.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..api import Generator
from ..drafters import default_drafter, make_drafter
from ..errors import SpeculantError
from ..models.cpu_kernels import machine_key
from ..models.fast import supports
from ..models.loading import _LOADED, cache_dir, load_model, resolve_model_folder, resolve_model_path

# in the order of faithfulness to HF ``generate`` in float32 (see ``pick``); q8 and quantized: a .gguf target only
CANDIDATES = ("float32", "quantized", "bfloat16", "q8")
CHOICE_VERSION = 5  # in the cache key: choices made before float32 ran on the kernel core with its drafters on the int8 kernels (or q8, the measuring bound) are made again
# a request of the usual shape: some context (its prefill counts: on AVX2 a bf16 prefill costs ~6x a
# float32 one, 12 against 2 ms a token for the default model) and a question about it
PROMPT = (
    "Read this note and answer the question after it.\n\n"
    "A bicycle's drivetrain links the pedals to the rear wheel through a chain that runs over a front "
    "chainring and one of several rear sprockets. The rider changes gear with a derailleur, which pushes "
    "the chain sideways onto a larger or smaller sprocket. A small chainring with a large sprocket is a "
    "low gear: every turn of the pedals turns the wheel less than once, so each stroke needs less force "
    "but moves the bicycle a shorter distance. A large chainring with a small sprocket is a high gear, "
    "for speed on flat roads and descents. Cadence, the number of pedal turns a minute, stays "
    "comfortable when the rider shifts before a climb rather than halfway up it, because shifting under "
    "heavy load strains the chain and can make it slip.\n\n"
    "Question: why does a low gear make riding uphill easier, and when should a rider shift?"
)
NEW_TOKENS = 24  # a timed request's new tokens (after a warm-up request of WARMUP_TOKENS)
WARMUP_TOKENS = 8
# the measuring stops within about this many seconds however slow or loaded the machine: a candidate
# whose timed request would end past it keeps its warm-up's rate (an upper bound), and candidates not
# reached by then are not measured (said so)
MEASURE_BOUND_S = 45.0


@dataclass
class Choice:
    dtype: str
    path: str  # "fast" or "general"
    ms_per_token: dict  # candidate dtype -> measured ms per new token (prefill included)
    cached: bool = False
    reason: str = ""  # why nothing was measured

    def describe(self) -> str:
        if self.reason:
            return f"auto: {self.dtype} on the {self.path} path ({self.reason})"
        others = ", ".join(f"{d} {ms:.1f}" for d, ms in self.ms_per_token.items() if d != self.dtype)
        return (f"auto: {self.dtype} on the {self.path} path, {self.ms_per_token[self.dtype]:.1f} ms/token "
                f"({f'vs {others}' if others else 'the only dtype measured'}; "
                f"{'cached' if self.cached else 'measured now'})")


def _drafter_key(drafter: str | None) -> str:
    return "default" if drafter is None else str(drafter)


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


# a GGUF of an architecture the int8 kernels run is read straight into them: its own blocks stream
# 3-6x fewer bytes a token than float32 or bfloat16 copies (the 135M default: 2.9 against 7.9 ms a
# token on a Zen 4; a 1.5B Q4_K_M could not even be measured in float32 within 15 minutes)
DIRECT = "a GGUF read straight into the int8 kernels: nothing measured"


def choose(spec: str, drafter: str | None = "none", log=None) -> Choice:
    """The cached choice for this machine, model and drafter (a spec string; None: the target's
    default drafter), or a new measurement (seconds, once). A GGUF the int8 kernels read directly
    is q8 at once (``DIRECT``)."""
    from ..models import gguf_model

    target = resolve_model_path(spec)
    if target.is_file() and gguf_model.reads_directly(target):
        return Choice("q8", "fast", {}, reason=DIRECT)
    raw = f"{machine_key()}||{_model_key(spec)}||{_drafter_key(drafter)}||{CHOICE_VERSION}"
    key = hashlib.sha256(raw.encode()).hexdigest()[:20]
    entry = _read_cache().get(key)
    if entry and entry.get("dtype") in CANDIDATES:
        return Choice(entry["dtype"], entry["path"], entry["ms_per_token"], cached=True, reason=entry.get("reason", ""))
    choice = measure(spec, drafter, log=log or (lambda msg: print(msg, file=sys.stderr, flush=True)))
    data = _read_cache()
    data[key] = {"dtype": choice.dtype, "path": choice.path, "ms_per_token": choice.ms_per_token, "reason": choice.reason,
                 "machine": machine_key(), "model": str(spec), "drafter": _drafter_key(drafter)}
    _cache_file().parent.mkdir(parents=True, exist_ok=True)
    tmp = _cache_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(_cache_file())
    return choice


def measure(spec: str, drafter: str | None = "none", rounds: int = 1, log=lambda msg: None,
            bound_s: float = MEASURE_BOUND_S) -> Choice:
    """Time a greedy request (``PROMPT``) with each candidate dtype and the drafter, the likely fastest
    first, and keep the best by ``pick`` (ms per new token, prefill included), within ``bound_s``
    seconds. ``log`` hears of the measuring only once the first candidate is built: a bad drafter
    spec has failed by then, with its own one-line error and nothing else."""
    path = best_path(spec)
    names = sorted(candidates(spec, path), key=MEASURING_ORDER.index)
    first = _generator(spec, names[0], drafter, path)
    log(f"speculant: measuring which dtype generates fastest on this CPU with drafter {_drafter_key(drafter)}: "
        f"{', '.join(names)}, at most ~{bound_s:.0f} s (once for this machine, model and drafter; cached in "
        f"{_cache_file()}: delete it to measure again)")
    start, best = time.perf_counter(), {}
    for i, dtype in enumerate(names):
        if best and time.perf_counter() - start > bound_s:
            log(f"speculant: {bound_s:.0f} s spent measuring: {', '.join(names[i:])} not measured")
            break
        gen, prompt = first if i == 0 else _generator(spec, dtype, drafter, path)
        left = bound_s - (time.perf_counter() - start)
        # a later candidate whose first requests alone would pass the bound is not started (the first
        # is always measured: something must be chosen)
        if best and estimated_s(gen.target.model, len(prompt)) > left:
            log(f"speculant:   {dtype}: not measured (its first request would take ~"
                f"{estimated_s(gen.target.model, len(prompt)):.0f} s, past the bound)")
            continue
        # a first token, untimed: the one-time work of a model's first request (the general path's
        # width checks of each matmul shape, seconds to a minute and a half for a big vocabulary)
        # is not a token's cost; it counts against the bound all the same
        _request(gen, prompt, 1)
        warm = _request(gen, prompt, WARMUP_TOKENS)  # allocator, oneDNN primitives, the engine's cost model
        left = bound_s - (time.perf_counter() - start)
        timed = [] if warm * NEW_TOKENS / 1e3 > left else [_request(gen, prompt, NEW_TOKENS) for _ in range(rounds)]
        best[dtype] = min(timed, default=warm)
        log(f"speculant:   {dtype}: {best[dtype]:.1f} ms/token" + ("" if timed else " (its warm-up: the bound was near)"))
    winner = pick(best)
    kept = load_model(spec, device="cpu", dtype=winner)
    for key in [k for k, v in _LOADED.items() if v is not kept and k[1] == "cpu"]:
        if key[0] == str(_folder_of(spec)):
            del _LOADED[key]  # the losers' weights are not kept
    choice = Choice(winner, path, {d: round(ms, 2) for d, ms in best.items()})
    log(f"speculant: {choice.describe()}")
    return choice


def estimated_s(model, prompt_tokens: int) -> float:
    """About the seconds a candidate's first requests take (the untimed first token and the warm-up):
    its prompt's prefill at 2 FLOPs a parameter a token, ~20 GFLOP/s (a 2-core CPU in float32), and
    9 tokens streaming its weights at ~10 GB/s: a 135M model ~3 s, a 1.5B in float32 ~35 s."""
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return 2 * params * prompt_tokens / 20e9 + 9 * nbytes / 10e9


# the measuring order: the likely fastest first, so a bound reached early still saw them
MEASURING_ORDER = ("q8", "quantized", "float32", "bfloat16")


def _generator(spec: str, dtype: str, drafter: str | None, path: str):
    lm = load_model(spec, device="cpu", dtype=dtype)
    gen = Generator(lm, make_drafter(default_drafter(lm) if drafter is None else drafter, lm), None, path)
    return gen, gen.encode(PROMPT)[-max(8, lm.context_length - NEW_TOKENS - 1):]  # fits a short context


# a dtype further from HF's float32 arithmetic must be this much faster than each closer one to be
# chosen: float32's greedy output is HF's token for token, quantized weights' parts from it only at
# near-ties, bfloat16 and q8 (int8 activations) more often; and a smaller gap is within a busy
# machine's noise (measured beside another process: bf16 1030.5 against float32 1037.1 ms a token,
# then 2.5x slower in use)
MUST_WIN_BY = 0.10


def pick(ms_per_token: dict) -> str:
    """The dtype to run from measured ms per token: going from the most faithful to HF's float32
    arithmetic (``CANDIDATES``' order) to the least, a dtype replaces the choice so far only where
    it is faster by a clear margin."""
    chosen = None
    for dtype in CANDIDATES:
        ms = ms_per_token.get(dtype)
        if ms is not None and (chosen is None or ms < (1 - MUST_WIN_BY) * ms_per_token[chosen]):
            chosen = dtype
    return chosen or "float32"


def candidates(spec: str, path: str) -> tuple[str, ...]:
    """float32 and bfloat16; quantized weights too, with float32 and with int8 activations, for a .gguf
    target on the fast path whose kernels build on this machine (``models/quantized.py``)."""
    from ..models import quantized  # the kernels' build: only when a GGUF could use them

    dense = ("float32", "bfloat16")
    if path != "fast" or not resolve_model_path(spec).is_file() or quantized.kernels() is None:
        return dense
    try:
        load_model(spec, device="cpu", dtype="quantized")
    except SpeculantError:  # no linear in a format with a kernel
        return dense
    return CANDIDATES


def best_path(spec: str) -> str:
    """The fast path where the architecture has one (faster on every CPU measured), else the general one."""
    return "fast" if supports(load_model(spec, device="cpu", dtype="float32").model)[0] else "general"


def _folder_of(spec: str) -> Path:
    return resolve_model_folder(spec)[0].resolve()


def _request(gen, prompt: list[int], new_tokens: int) -> float:
    """Milliseconds per new token of one greedy request."""
    t = time.perf_counter()
    out = gen.generate_ids([prompt], max_new_tokens=new_tokens)[0]
    return (time.perf_counter() - t) / max(1, len(out.token_ids)) * 1e3

"""Which KV state (and forward) a model runs with: the fast static-cache path or the general one."""
from __future__ import annotations

import os
import sys

import torch

from ..errors import SpeculantError
from . import invariant, quantized
from .cuda_graphs import GraphedForward
from .fast import FastLlama, StaticKVState, supports
from .kv import KVState
from .loading import cache_dir

PATHS = ("auto", "fast", "general")


def use_persistent_compile_cache() -> None:
    """Keep torch.compile's compiled kernels (inductor's FX-graph and autograd caches) under
    $SPECULANT_CACHE/inductor instead of /tmp, so compiling is paid once per machine, not per boot.
    A TORCHINDUCTOR_CACHE_DIR of the user's own (not inductor's /tmp default) wins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # inductor: seconds to import

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


def kv_bytes(model: torch.nn.Module, batch: int, tokens: int, element: int | None = None) -> int:
    """About the bytes a KV cache of ``batch`` rows of ``tokens`` tokens takes for a HF-configured
    causal LM: keys and values of every layer (0 where the model names no shapes), ``element``
    bytes a value (default: the model's parameters')."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", cfg)
    heads = getattr(cfg, "num_attention_heads", None)
    if not heads:
        return 0
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    element = element or next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * batch * kv_heads * tokens * head_dim * element


RECURRENT = ("linear", "mamba", "conv", "recurrent", "ssm")  # layer kinds whose state is not per-token K/V


def recurrent_layers(model: torch.nn.Module) -> list[str]:
    """The kinds of layer in ``model`` that carry a recurrent state instead of a KV cache (Qwen3-Next's
    and Qwen3.5's linear attention, Mamba layers): a state summing every token seen, which cannot drop
    the tokens of a rejected draft."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    kinds = list(getattr(cfg, "layer_types", None) or []) + list(getattr(cfg, "layers_block_type", None) or [])
    return sorted({k for k in kinds if isinstance(k, str) and any(r in k for r in RECURRENT)})


class Backend:
    """Makes KV states for one model.

    path: auto (fast when the architecture is supported, else general), fast, general.
    graphs: on CUDA, replay the fast forward as CUDA graphs (default on with the fast path there).
    compile: wrap the fast forward in torch.compile (the CPU's equivalent: fused C++ kernels).
    kernels: the CPU fast path's matmul kernels ("auto", "onednn", "aten"; see cpu_kernels).
    """

    def __init__(self, model: torch.nn.Module, path: str = "auto", compile: bool = False, quiet: bool = False,
                 graphs: bool | None = None, kernels: str | None = None):
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}")
        self.model = model
        device = next(model.parameters()).device
        recurrent = recurrent_layers(model)
        if recurrent:
            mtype = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise SpeculantError(f"model type {mtype!r} has {', '.join(recurrent)} layers, whose recurrent state "
                                 "cannot roll a rejected draft back: speculant runs models whose layers all attend "
                                 "over a KV cache")
        ok, why = supports(model)
        if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
            ok, why = False, "the model is spread over several devices (device_map)"  # the fast path is one device's
        # auto: the fast path wherever the architecture has one (faster on every device measured)
        want_fast = path in ("fast", "auto")
        if (path == "fast" or compile) and not ok and not quiet:
            print(f"speculant: {why}; using the general path", file=sys.stderr)
        if compile:
            use_persistent_compile_cache()
        if quantized.weights_of(model) and compile:
            raise SpeculantError("compile does not apply to quantized weights (their kernels are compiled C++ "
                                 "already): drop --compile, or use dtype float32 or bfloat16")
        if quantized.weights_of(model) and not (want_fast and ok):
            raise SpeculantError(f"quantized weights run on the fast path only ({why or 'path ' + path + ' asked for'}): "
                                 f"use dtype auto, float32 or bfloat16")
        self.fast = FastLlama(model, compile=compile, kernels=kernels) if want_fast and ok else None
        self.step = None
        self.name = "general"
        self.dtype_choice: str | None = None  # how dtype "auto" chose (speculant.load), for the stats
        self.caches: dict[tuple[int, int], tuple[list, list]] = {}
        self.in_use: set[tuple[int, int]] = set()  # shapes whose cache a live batch holds
        if self.fast is not None:
            self.name = "fast+compiled" if compile else "fast"
            if device.type == "cuda" and (graphs is None or graphs):
                self.step = GraphedForward(self.fast.forward)
                self.name += "+cudagraphs"

    def info(self) -> dict:
        """What runs the model, for the stats: path, dtype, on the CPU fast path the matmul kernels,
        and whether speculative output is plain decoding's bit for bit (``exact``: "bitwise") or may
        part from it at a rounding near-tie ("near-ties"), with the width-invariant kernels chosen."""
        p = next(self.model.parameters())
        out = {"path": self.name, "dtype": str(p.dtype).removeprefix("torch.")}
        if self.fast is not None and p.device.type == "cpu":
            out["cpu_kernels"] = self.fast.kernels
        if self.fast is not None:
            out["exact"] = self.fast.exact
            out["width_invariance"] = self.fast.invariance
        else:  # the general path: HF's forward on the invariant kernels, proven on CPUs only
            ok = invariant.supports_hf(self.model) and p.device.type == "cpu"
            out["exact"] = "bitwise" if ok else "near-ties"
        if self.dtype_choice:
            out["dtype_choice"] = self.dtype_choice
        return out

    def state_bytes(self, batch: int, max_tokens: int) -> int:
        """About the bytes ``new_state(batch, max_tokens)`` takes."""
        if self.fast is None:
            return kv_bytes(self.model, batch, max_tokens)
        return kv_bytes(self.model, batch, -(-max_tokens // 256) * 256, self.fast.cache_dtype.itemsize)

    def prefill_bytes(self, tokens: int) -> int:
        """About the bytes a prompt of ``tokens`` tokens takes while it is prefilled (prompts are
        prefilled one at a time): a layer's activations, measured at ~16 hidden-sized and 4
        MLP-sized vectors a token (the attention kernel keeps no token-by-token matrix)."""
        cfg = getattr(self.model, "config", None)
        cfg = getattr(cfg, "text_config", cfg)
        hidden = getattr(cfg, "hidden_size", None)
        if not hidden:
            return 0
        inner = getattr(cfg, "intermediate_size", None) or 4 * hidden
        return tokens * (16 * hidden + 4 * inner) * 4  # float32 activations where the weights are float32 or quantized

    def new_state(self, batch: int, max_tokens: int):
        if self.fast is None:
            return KVState(self.model, batch)
        size = -(-max_tokens // 256) * 256  # round up: fewer distinct shapes to capture or compile
        if (batch, size) in self.in_use:  # another live batch holds that one: a cache of its own (not graphed)
            return StaticKVState(self.fast, self.fast.new_cache(batch, size))
        self.in_use.add((batch, size))
        # one cache per shape, reused by later requests, so captured graphs stay valid and replay
        if (batch, size) not in self.caches:
            idle = [k for k in self.caches if k not in self.in_use]
            if len(self.caches) >= 4 and idle:  # keep memory bounded: drop the oldest idle cache and its graphs
                old = idle[0]
                if hasattr(self.step, "forget"):
                    self.step.forget(*self.caches[old])
                del self.caches[old]
            self.caches[(batch, size)] = self.fast.new_cache(batch, size)
        state = StaticKVState(self.fast, self.caches[(batch, size)], self.step)
        state.cache_key, state.pool = (batch, size), self  # the pool's cache: given back by release (or a join)
        return state

    def release(self, state) -> None:
        """A batch is done with ``state``: its shared cache may serve the next one. Without captured
        graphs to keep valid (a CPU), idle caches are kept only up to IDLE_CACHE_BYTES in all: a
        large batch's cache goes back to the system when the batch ends."""
        self.in_use.discard(getattr(state, "cache_key", None))
        if self.step is None:
            idle = [k for k in self.caches if k not in self.in_use]
            while idle and sum(_cache_bytes(self.caches[k]) for k in idle) > IDLE_CACHE_BYTES:
                del self.caches[idle.pop(0)]

    def idle_bytes(self) -> int:
        """Bytes of the caches kept for reuse that no live batch holds."""
        return sum(_cache_bytes(c) for k, c in self.caches.items() if k not in self.in_use)

    def drop_idle(self) -> None:
        """Give back every cache no live batch holds (and its captured graphs)."""
        for key in [k for k in self.caches if k not in self.in_use]:
            if hasattr(self.step, "forget"):
                self.step.forget(*self.caches[key])
            del self.caches[key]


IDLE_CACHE_BYTES = 64 * 2**20  # idle KV caches a CPU backend keeps for the next request of their shape


def _cache_bytes(cache: tuple[list, list]) -> int:
    return sum(t.numel() * t.element_size() for part in cache for t in part)

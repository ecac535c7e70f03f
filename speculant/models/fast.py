"""The fast path for Llama-family models: our own compact forward over the model's weights and a
preallocated static KV cache with a length pointer per row (gpt-fast style).

- Rollback is moving a row's pointer back: rejected slots are simply overwritten later.
- Rows of a batch write at their own positions (scatter), so rows that accepted different numbers
  of tokens never leave holes; a query at position t sees exactly the slots 0..t of its row.
- Every step has static shapes (batch, block width, cache size), so the decode step and each
  (γ+1)-token verification step can be captured as CUDA graphs (``torch.compile``,
  mode="reduce-overhead") or compiled for the CPU.
- The math follows transformers' Llama modules (float32 RMSNorm statistics, rotary tables cast to
  the activation dtype); the prefill is HF's own computation (SDPA, ``F.linear``; over quantized
  weights a short prompt runs the passes' kernels instead), and every other pass runs
  width-invariant kernels (``invariant``): a row gets the bits a one-token step gives it in any
  block, tree or batch, so speculative text is plain decoding's bit for bit.

Supported: model types whose decoder layer is Llama's (llama, mistral without sliding window,
qwen2, smollm): see ``supports``. Anything else runs on the general path (``KVState``).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SpeculantError
from ..rows import PerRow
from . import cpu_attention, cpu_kernels, gguf_model, invariant, native, quantized
from .cpu_kernels import PackedLinear
from .invariant import FLinear, KeyLayout, RowLinear
from .quantized import DenseWeight, PackedQ8, QuantEmbedding, QuantLinear, QuantWeight

FAST_MODEL_TYPES = {"llama", "mistral", "qwen2"}
MATMULS = ("q", "k", "v", "o", "gate", "up", "down")


def supports(model: torch.nn.Module) -> tuple[bool, str]:
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if not hasattr(getattr(model, "model", None), "layers"):
        return False, f"{type(model).__name__} is not a Llama-style causal LM"
    if mtype not in FAST_MODEL_TYPES:
        return False, f"model type {mtype!r} has no fast path"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and mtype != "llama":
        return False, "sliding-window attention has no fast path"
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        return False, f"activation {act!r} has no fast path"
    return True, ""


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rows=None) -> torch.Tensor:
    """HF's RMSNorm; ``rows``: the calls' rows window (a CUDA reduction orders a row's sum by how many
    rows the call holds: float32 on an H200 from 13 rows up)."""
    if rows is not None and not (rows.lo == 1 and x.numel() <= rows.hi * x.shape[-1]):
        return RowLinear(lambda t: _rms_norm(t, weight, eps), rows)(x)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class _MatmulSet:
    """The weights one kind of pass multiplies with, and how its layers run over them."""

    layers: list[dict]  # per layer: norms and matmul weights (a "<name>_packed" entry wins over F.linear)
    head: object  # the lm_head: a module, a PackedLinear or a RowLinear
    layer_fn: object  # decoder_layer, or its torch.compile'd twin, or quantized_layer
    final_norm: object = None  # h -> the final norm's output: None for _rms_norm
    # () -> every layer in one call (BoundLayers), or None
    all_layers: object = None


def _linear(x, w: dict, name: str):
    packed = w.get(name + "_packed")
    return packed(x) if packed is not None else F.linear(x, w[name], w.get(name + "_bias"))


def _window(fn, kind, dtype: torch.dtype, device: str) -> invariant.Rows:
    """The rows window of a matmul like ``fn``: F.linear (``kind`` None), packed as (compute, hint),
    or over quantized weights."""
    if isinstance(fn, QuantLinear) and isinstance(fn.weight, DenseWeight):
        bits = fn.weight.bits
        return invariant.linear_rows(f"kernel core {bits}-bit weights", lambda w, b: QuantLinear(
            DenseWeight.bfloat16_of(w) if bits == 16 else DenseWeight(w.contiguous()), b),
                                     dtype, fn.in_features, fn.out_features, fn.bias is not None, device)
    if isinstance(fn, QuantLinear) and isinstance(fn.weight, PackedQ8):
        # blocks of the same kinds, random: a row's sums are its own whatever the weight's values
        # (a kernel-core kind, width-invariant by construction); at most 256 outputs checked (a
        # 151,936-row LM head's check would make 0.9 GB of weights)
        w, outs = fn.weight, min(fn.out_features, 256)
        return invariant.linear_rows(f"q8 kinds {w.bits}", lambda _, b: QuantLinear(w.random_like(outs), b),
                                     dtype, fn.in_features, outs, fn.bias is not None, device)
    if isinstance(fn, QuantLinear):
        bits, int8 = fn.weight.bits, fn.int8
        return invariant.linear_rows(f"quantized {bits}-bit" + (" int8" if int8 else ""),
                                     lambda w, b: QuantLinear(QuantWeight.quantize(w, bits), b, int8),
                                     dtype, fn.in_features, fn.out_features, fn.bias is not None, device)
    if kind is None:
        return invariant.linear_rows("F.linear", FLinear, dtype, fn.in_features, fn.out_features,
                                     fn.bias is not None, device)
    compute, hint = kind
    return invariant.linear_rows(f"onednn {compute} hint {hint}", lambda w, b: PackedLinear(w, b, compute, hint),
                                 dtype, fn.in_features, fn.out_features, fn.bias is not None, device)


def _qk_v(x, w: dict, B: int, T: int, n_heads: int, n_kv: int, head_dim: int):
    """q and k heads side by side [B, T, n_heads + n_kv, head_dim] (one rotary pass serves both), and v."""
    fused = w.get("qkv_packed")
    if fused is not None:  # one matmul for q, k and v
        qkv = fused(x).view(B, T, n_heads + 2 * n_kv, head_dim)
        return qkv[:, :, : n_heads + n_kv], qkv[:, :, n_heads + n_kv :]
    q = _linear(x, w, "q").view(B, T, n_heads, head_dim)
    k = _linear(x, w, "k").view(B, T, n_kv, head_dim)
    return torch.cat([q, k], 2), _linear(x, w, "v").view(B, T, n_kv, head_dim)


def _mlp(x, w: dict):
    fused = w.get("gateup_packed")
    if fused is not None:  # one matmul for gate and up
        gate, up = fused(x).chunk(2, dim=-1)
    else:
        gate, up = _linear(x, w, "gate"), _linear(x, w, "up")
    return _linear(F.silu(gate) * up, w, "down")


def decoder_layer(h, cos, sin, attend, idx, k_cache, v_cache, w: dict, n_heads: int, n_kv: int, head_dim: int,
                  eps: float, scaling: float, gqa: bool = False):
    """One Llama decoder layer over a block of w tokens, writing its K/V into the static cache.

    A pure function of tensors (weights passed in), so ``torch.compile`` compiles it once and every
    layer reuses the same kernels: compile time does not grow with depth. cos/sin: [B, T, 1, head_dim].
    ``attend(q, k_cache, v_cache)``: the width-invariant attention of the pass; None for a prefill
    from position 0 (SDPA's causal kernel over the prompt, the very call HF makes)."""
    B, T, _ = h.shape
    x = _rms_norm(h, w["ln1"], eps, w.get("norm_rows"))
    qk, v = _qk_v(x, w, B, T, n_heads, n_kv, head_dim)
    qk = qk * cos + _rotate_half(qk) * sin  # elementwise: the same values as HF's separate q and k passes
    # idx = (rows, slots) [B, T]: advanced-index writes (scatter_ along the slot axis runs ~100x
    # slower on CPU once B > 1)
    k_cache.transpose(1, 2).index_put_(idx, qk[:, :, n_heads:])
    v_cache.transpose(1, 2).index_put_(idx, v)
    q = qk[:, :, :n_heads].transpose(1, 2)
    if attend is None:
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, is_causal=T > 1, scale=scaling, enable_gqa=gqa)
    else:
        o = attend(q, k_cache, v_cache)
    h = h + _linear(o.transpose(1, 2).reshape(B, T, -1), w, "o")
    return h + _mlp(_rms_norm(h, w["ln2"], eps, w.get("norm_rows")), w)


_NO_SLOTS = torch.empty(0, 0, 0, dtype=torch.long)
# prompts up to this many tokens prefill through the quantized kernels, faster there than the dense
# float32 matmuls (25 tokens: 58 against 133 ms, 128: 270 against 347) and slower from a few hundred
# (600: 1.31 s against 1.09; a 2-core Zen 4, benchmarks/results/cpu-AVX512BF16-2026-11-26-quantized-roofline)
QUANTIZED_PREFILL_MAX = 128
# over a float32 model's own weights (``core_kernels``) from fewer: their rows cost more to multiply
# than blocks' (16 tokens: 92 against 116 ms; 32: 183 against 155; a 2-core Zen 3)
DENSE_PREFILL_MAX = 24


def _kernel_attention(attention: invariant.Attention, head_dim: int) -> bool:
    """Whether chains and trees alike attend through the compiled CPU kernel, with heads the compiled
    layers attend over themselves (whole 16-float rows; other head dims go through ``attend``)."""
    kinds = {getattr(attention, "chain", ("",))[0], getattr(attention, "tree", ("",))[0]}
    return kinds == {"kernel"} and head_dim % cpu_attention.LANES == 0


class PassAttention:
    """A pass's attention, ``attend(q, keys, values)``; ``kernel``: it is the compiled CPU kernel,
    which a quantized layer calls itself with ``layout`` and ``scaling`` (the layer in one call)."""

    def __init__(self, attention: invariant.Attention, layout: KeyLayout, scaling: float, head_dim: int):
        self.attention, self.layout, self.scaling = attention, layout, scaling
        self.kernel = _kernel_attention(attention, head_dim)

    def __call__(self, q, keys, values):
        return self.attention(q, keys, values, self.layout, self.scaling)


def quantized_layer(h, cos, sin, attend, idx, k_cache, v_cache, w: dict, n_heads: int, n_kv: int, head_dim: int,
                    eps: float, scaling: float, gqa: bool = False):
    """``decoder_layer`` over quantized weights (``quantized``): the norms, matmuls, rotary, cache
    writes, attention, SiLU and residuals in one compiled call (two around attention in PyTorch ops
    where the compiled attention kernel is not in use), each row computed alone (width-invariant by
    construction): ~45 PyTorch ops a layer, most of a one-token step's overhead, become one."""
    B, T, H = h.shape
    k = quantized.kernels()
    q = w["quantized"]
    qkv, gate_up, o, down = q["qkv"], q["gateup"], q["o"], q["down"]
    if getattr(attend, "kernel", False):  # the compiled attention: the whole layer in one call
        lay = attend.layout
        return k.layer(h, w["ln1"], eps, qkv.args, qkv.weight.bits, cos, sin, n_heads, n_kv, head_dim, k_cache, v_cache,
                       idx[1], _NO_SLOTS if lay.order is None else lay.order, lay.count, scaling, o.args, o.weight.bits,
                       w["ln2"], gate_up.args, gate_up.weight.bits, down.args, down.weight.bits)
    y = k.layer_start(h, w["ln1"], eps, qkv.args, qkv.weight.bits, cos, sin, n_heads + n_kv, head_dim)
    y = y.view(B, T, n_heads + 2 * n_kv, head_dim)
    k_cache.transpose(1, 2).index_put_(idx, y[:, :, n_heads : n_heads + n_kv])
    v_cache.transpose(1, 2).index_put_(idx, y[:, :, n_heads + n_kv :])
    a = attend(y[:, :, :n_heads].transpose(1, 2), k_cache, v_cache).transpose(1, 2).reshape(B, T, -1)
    return k.layer_end(h, a, o.args, o.weight.bits, w["ln2"], eps, gate_up.args, gate_up.weight.bits, down.args,
                       down.weight.bits).view(B, T, H)


class BoundLayers:
    """Every quantized decoder layer bound in the kernels once (their weights checked and held
    there), so a pass whose attention is the compiled kernel runs them all in ONE call: each layer
    exactly as ``quantized_layer`` runs it, without 30 calls' argument conversions (~10 µs a layer)."""

    def __init__(self, layers: list[dict], n_heads: int, n_kv: int, head_dim: int, eps: float, ends: tuple = ()):
        k = quantized.kernels()
        norms, linears, bits = self.weights(layers)
        self.handle = k.bind_layers(norms, eps, linears, bits, n_heads, n_kv, head_dim)
        weakref.finalize(self, k.unbind_layers, self.handle)
        # ``run_pass``: the embeddings, the final norm and the LM head bound too (not in a kernels build of
        # a revision before it, as the A/B scripts' ``--base`` loads)
        self.whole_passes = bool(ends) and hasattr(k, "bind_ends")
        if self.whole_passes:
            k.bind_ends(self.handle, *ends)

    @staticmethod
    def weights(layers: list[dict]) -> tuple[list, list, list]:
        """``bind_layers``' weight arguments: the layers' norms, their linears' packed arguments and
        kinds, in the kernel's order."""
        norms, linears, bits = [], [], []
        for w in layers:
            q = w["quantized"]
            norms += [w["ln1"], w["ln2"]]
            for lin in (q["qkv"], q["o"], q["gateup"], q["down"]):
                linears.append(lin.args)
                bits.append(lin.weight.bits)
        return norms, linears, bits

    def __call__(self, h, cos, sin, keys, values, write_at, layout: KeyLayout, scaling: float, taps: tuple = ()):
        """(the last layer's output, the inputs of the layers ``taps`` [B, T, len(taps), H])"""
        return quantized.kernels().run_layers(self.handle, h, cos, sin, keys, values, write_at,
                                              _NO_SLOTS if layout.order is None else layout.order, layout.count,
                                              scaling, list(taps))

    def run_pass(self, tokens, positions, rotary_table: tuple, keys, values, write_at, layout: KeyLayout,
                 scaling: float, taps: tuple, last_only: bool):
        """A whole pass in one call (``whole_passes``): (logits [B, T or 1, V], the inputs of the layers
        ``taps`` [B, T, len(taps), H], where the layer count stands for the final norm's output). What
        the embedding, the rotary rows, ``__call__``, the final norm and the LM head give one by one, the
        same bits, without their PyTorch calls: run after the layers have streamed ~100 MB through the
        caches, a one-token step's dozen small calls took ~0.2 ms of its ~3.6 (2-core Zen 3)."""
        return quantized.kernels().run_pass(self.handle, tokens.contiguous(), positions.contiguous(),
                                            rotary_table[0], rotary_table[1], keys, values, write_at,
                                            _NO_SLOTS if layout.order is None else layout.order, layout.count,
                                            scaling, list(taps), last_only)


def position_table(table: tuple | None, below: int, formula, device) -> tuple:
    """A table of a per-position formula (rotary cos and sin) that holds positions 0..below-1:
    ``table`` itself, or ``formula`` over a new length (at least 256, doubled as texts grow), so a
    pass indexes its rows instead of computing them; each row the very values the formula gives
    that position alone (one elementwise formula)."""
    if table is None or table[0].shape[0] < below:
        table = formula(torch.arange(max(256, 1 << (below - 1).bit_length()), device=device))
    return table


def _plain_weights(layer) -> dict:
    """A decoder layer's own weights by name: its norms and matmuls (and their biases, where any)."""
    a, m = layer.self_attn, layer.mlp
    w = {"ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight}
    for name, proj in zip(MATMULS, (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)):
        w[name] = proj.weight
        if proj.bias is not None:  # Qwen2's q/k/v; attention_bias / mlp_bias configs
            w[f"{name}_bias"] = proj.bias
    return w


class KernelSet(_MatmulSet):
    """The kernels every pass after the prefill runs, behind one interface: ``layer_fn`` over each
    layer's weights, the LM head, the final norm, the attention; ``name`` and ``invariance`` are what
    the stats report of them. Made by one of ``compiled_kernels``, ``dense_kernels``,
    ``quantized_kernels`` and ``core_kernels``, chosen in one place: ``choose_kernels``."""

    dense = False  # a float32 model's own weights on the kernels (``core_kernels``)

    def __init__(self, name: str, layers: list[dict], head, layer_fn, attention, invariance: dict, final_norm=None):
        super().__init__(layers, head, layer_fn, final_norm)
        self.name, self.attention, self.invariance = name, attention, invariance


def choose_kernels(fast: "FastLlama", plain: list[dict], compile: bool, kernels: str | None,
                   qweights: dict | None) -> KernelSet:
    """The one place a model's kernel set is chosen: compiled where asked; a GGUF's quantized blocks on
    a CPU in float32; a float32 model's own weights on the CPU kernels (``kernels`` auto or core, where
    they build and take every linear); else dense matmuls (CUDA's, or per CPU: oneDNN packs or F.linear)."""
    if compile:
        return compiled_kernels(fast, plain)
    if qweights and fast.device.type == "cpu" and fast.dtype == torch.float32:
        return quantized_kernels(fast, plain, qweights)
    if quantized.on_kernel_core(fast.hf_model, kernels):
        return core_kernels(fast, plain, quantized.dense_weights(fast.hf_model))
    return dense_kernels(fast, plain, kernels)


def core_kernels(fast: "FastLlama", plain: list[dict], dense: dict) -> KernelSet:
    """A float32 model's own weights on the kernels a GGUF's blocks run on (``quantized_kernels``): every
    layer and the LM head in one call a pass, the weights read as the model holds them (a oneDNN
    pack was a second copy, and its step ~2x the bytes' time on a 2-core Zen 3), or a bfloat16 copy
    where every value is a bfloat16 one (``quantized.dense_weights``: half the bytes, the same bits).
    q/k/v and gate/up are stacked into one weight each; of float32 weights, the model's own modules
    then read views of it (no second copy; the values, and so HF's prefill, unchanged)."""
    ks = quantized_kernels(fast, plain, dense)
    ks.dense = True
    for i, w in enumerate(ks.layers):
        for name, group in (("qkv", ("q", "k", "v")), ("gateup", ("gate", "up"))):
            linear = w.get("quantized", {}).get(name)
            if linear is None or linear.weight.bits != 32:
                continue
            rows = 0
            for n in group:
                param = plain[i][n]
                param.data = linear.weight.tensor[rows : rows + param.shape[0]]
                rows += param.shape[0]
    return ks


def compiled_kernels(fast: "FastLlama", plain: list[dict]) -> KernelSet:
    """``torch.compile``'d layers over the plain weights, attention in PyTorch ops: inductor's own fused
    kernels, which the checks do not judge (exact: near-ties)."""
    return KernelSet("cuda" if fast.device.type == "cuda" else "aten (F.linear)", plain, fast.lm_head,
                     torch.compile(decoder_layer, dynamic=True), invariant.Attention(),
                     {"linears": "compiled", "attention": "compiled"})


def dense_kernels(fast: "FastLlama", plain: list[dict], kernels: str | None) -> KernelSet:
    """The model's own dense weights: F.linear (CUDA; a CPU without packing), or oneDNN-packed copies
    where they measure faster on this CPU (``cpu_kernels.plan``); each matmul within the rows window
    in which this machine keeps it width-invariant."""
    layers = [{n + "_packed": FLinear(w[n], w.get(n + "_bias")) for n in MATMULS} | w for w in plain]
    head, kind, name = FLinear(fast.lm_head.weight, fast.lm_head.bias), None, "cuda"
    if fast.device.type == "cpu":
        kplan = cpu_kernels.plan(fast.dtype, _matmul_bytes(plain, fast.lm_head), kernels)
        name = kplan.name
        # one kernel for steps and blocks alike: where they differed (bf16 without oneDNN bf16),
        # the blocks' float32 packs serve one-token steps too
        pack = kplan.block_pack or kplan.step_pack
        if pack is not None:
            layers, head = _packed(fast, plain, pack, kplan.hint)
            kind = (pack, kplan.hint)
    return _windowed(fast, name, layers, head, kind)


def quantized_kernels(fast: "FastLlama", plain: list[dict], qweights: dict) -> KernelSet:
    """A GGUF's own blocks (``quantized``: float32 or int8 activations): a decoder layer in one
    compiled call where every matmul of it is quantized and the shapes fit the kernels, else the
    quantized matmuls within the PyTorch layer; the LM head windowed like any matmul."""
    layers, head, name = _quantized(fast, plain, qweights)
    ks = _windowed(fast, name, layers, head, None)
    k, cfg = quantized.kernels(), fast.hf_model.config
    if all(len(w.get("quantized", ())) == 4 for w in ks.layers) and k is not None and cfg.hidden_size % 16 == 0 \
            and fast.head_dim % 2 == 0:
        ks.layer_fn = quantized_layer
        head = getattr(ks.head, "fn", None)
        # a pass's ends bound with its layers where they are what the kernels compute: an LM head of
        # the GGUF's blocks, float32 embeddings looked up as they are or their own blocks dequantized
        if isinstance(fast.embed, QuantEmbedding):
            embed = (torch.empty(0), QuantLinear(fast.embed.packed).args, fast.embed.packed.bits)
        elif type(fast.embed) is torch.nn.Embedding and fast.embed.weight.dtype == torch.float32 \
                and fast.embed.weight.is_contiguous():
            embed = (fast.embed.weight, [], 0)
        else:
            embed = None
        ends = (*embed, fast.norm.weight, fast.eps, head.args, head.weight.bits) if (
            isinstance(head, QuantLinear) and hasattr(head, "args") and embed is not None) else ()
        # bound at the first pass that runs them all (a model whose attention is not the kernel never is)
        ks.all_layers = functools.cache(lambda: BoundLayers(ks.layers, fast.n_heads, fast.n_kv, fast.head_dim,
                                                            fast.eps, ends))
        ks.final_norm = lambda h: k.norm(h.contiguous(), fast.norm.weight, fast.eps).view(h.shape)
        ks.invariance = {"layers": "quantized kernels (a row at a time)", "attention": ks.attention.describe(),
                         "lm_head": ks.invariance["linears"]}
    return ks


def _windowed(fast: "FastLlama", name: str, layers: list[dict], head, kind) -> KernelSet:
    """A kernel set whose matmuls and norms each run within their rows windows (``invariant``)."""
    windows = {}

    def rowed(fn):
        shape = (type(fn).__name__, getattr(fn.weight, "bits", None), getattr(fn, "int8", None), fn.in_features,
                 fn.out_features, fn.bias is not None)
        if shape not in windows:
            windows[shape] = _window(fn, kind, fast.dtype, fast.device.type)
        return RowLinear(fn, windows[shape])

    hidden = fast.hf_model.config.hidden_size
    # the norms' window, found as a matmul's (the weight here is just its size)
    norm_rows = invariant.linear_rows(f"rms_norm eps {fast.eps}", lambda w, b: lambda t: _rms_norm(t, w[0], fast.eps),
                                      fast.dtype, hidden, hidden, False, fast.device.type)
    layers = [{n: rowed(f) if n.endswith("_packed") else f for n, f in w.items()} | {"norm_rows": norm_rows}
              for w in layers]
    attention = invariant.attention_choice(fast.dtype, fast.n_heads, fast.n_kv, fast.head_dim, fast.device.type)
    invariance = {"linears": invariant.describe_windows(windows), "attention": attention.describe(),
                  "norms": norm_rows.describe()}
    return KernelSet(name, layers, rowed(head), decoder_layer, attention, invariance)


class FastLlama:
    """A functional view of a transformers Llama-family CausalLM: shares its weights (on CPU, oneDNN
    packed copies of the matmul weights are added where they measure faster: see cpu_kernels).

    ``kernels`` (CPU only): "auto" (default, or $SPECULANT_CPU_KERNELS), "onednn" or "aten"."""

    def __init__(self, hf_model: torch.nn.Module, compile: bool = False, kernels: str | None = None):
        cfg = hf_model.config
        inner = hf_model.model
        self.hf_model = hf_model
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.gqa = self.n_kv != self.n_heads  # a plain bool: torch.compile would make a SymBool of the ints
        self.embed = inner.embed_tokens
        plain = [_plain_weights(layer) for layer in inner.layers]
        self.norm = inner.norm
        self.lm_head = hf_model.get_output_embeddings()
        self.inv_freq = inner.rotary_emb.inv_freq
        self.rope_scale = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.scaling = inner.layers[0].self_attn.scaling
        p = next(hf_model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.compiled = compile
        self._rotary_table = None  # on a CPU: every position's cos and sin up to a length (``rotary``)
        self.int8 = quantized.int8_activations(hf_model)
        # every pass but the prefill (one-token steps, verify blocks, trees, batches) runs one kernel set
        self.pass_set = choose_kernels(self, plain, compile, kernels, quantized.weights_of(hf_model))
        self.kernels, self.attention, self.invariance = self.pass_set.name, self.pass_set.attention, self.pass_set.invariance
        if gguf_model.is_direct(hf_model) and self.pass_set.layer_fn is not quantized_layer:
            raise SpeculantError("a GGUF read straight into the int8 kernels runs on its compiled layers only, and "
                                 "this model's shapes do not fit them: load it with dtype float32")
        # q8 keeps its cache in float16 where its kernels attend (llama.cpp's default too): a long
        # context's attention streams half the bytes; keys and values are rounded once as they are
        # written and read back exactly, so every row still gets the same bits at any width
        on_kernels = (self.int8 and self.pass_set.layer_fn is quantized_layer
                      and _kernel_attention(self.attention, self.head_dim))
        self.cache_dtype = torch.float16 if on_kernels else self.dtype
        self._proven = None
        # the prefill runs HF's own F.linear calls and SDPA's causal kernel over each prompt alone, so
        # plain decoding starts from the very cache HF's does, whatever else shares the batch (over
        # quantized weights a short prompt runs the passes' kernels: see ``prefill``)
        self.prefill_set = _MatmulSet(plain, self.lm_head, decoder_layer)

    def new_cache(self, batch: int, size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (batch, self.n_kv, size, self.head_dim)
        keys = [torch.zeros(shape, device=self.device, dtype=self.cache_dtype) for _ in range(self.n_layers)]
        values = [torch.zeros(shape, device=self.device, dtype=self.cache_dtype) for _ in range(self.n_layers)]
        return keys, values

    def forward(self, tokens, positions, write_at, keys, values, last_only: bool = False, layers=None, tree=None,
                taps: tuple = ()):
        """tokens/positions/write_at: [B, w]. Writes K/V of the block at ``write_at`` and attends,
        for each query, to the slots at or before its position. Returns logits [B, w or 1, V].
        ``layers``: run only these decoder layers (self-speculation); None = all.
        ``tree``: [B, w, w] bool, a token tree's block (written at consecutive slots from write_at[:, 0]):
        query t sees the slots before the block and the block slots s with tree[b, t, s].
        ``taps``: layer ids whose hidden states come back too, as (logits, hidden [B, w, len(taps), H]):
        id L < n_layers is the input of decoder layer L, id n_layers the final normed hidden state
        (Hugging Face's ``output_hidden_states[L]``).

        Every row gets the bits it would get alone as a one-token step (see ``invariant``): the
        matmuls run within their rows windows and attention reads each query's keys in text order."""
        # on a CPU attention reads the live part of the cache only (its work follows the text's
        # length); on a GPU shapes stay static for CUDA graphs, so every pass reads the whole cache
        static = tokens.device.type != "cpu"
        S = keys[0].shape[2] if static else int(write_at.max()) + 1
        if tree is not None:  # on a CPU in one kernel call where the kernels are built
            layout = invariant.tree_key_layout(write_at[:, 0], tree, S, self.dtype, static,
                                               None if static else native.built())
        else:
            # a chain's positions are its slots (KVState.append): their largest count is S
            layout = invariant.key_layout(positions + 1, self.dtype, span=S if static else None,
                                          most=S if positions is write_at else None)
        idx = (None, write_at)  # the rows' index: made where a layer's writes need it (_body)
        return self._body(tokens, positions, idx, keys, values, layout, last_only, self.pass_set, layers, taps,
                          below=S)

    def prefill(self, tokens, keys, values, last_only: bool = False, taps: tuple = ()):
        """One prompt [1, n] from position 0 into a cache row (views [1, ...]): HF's own computation
        (causal SDPA over the prompt, HF's F.linear), whatever other rows the cache holds. Over
        quantized weights a prompt of up to ``QUANTIZED_PREFILL_MAX`` tokens (over a float32 model's own
        weights on the kernels ``DENSE_PREFILL_MAX``) runs as one block of the passes' kernels instead
        (each row alone: its cache is the one one-token steps would write), where they are faster
        than HF's dense float32 matmuls; with int8 activations
        (``q8``) every prompt does: that mode is int8 arithmetic throughout."""
        n = tokens.shape[1]
        positions = torch.arange(n, device=tokens.device)[None]
        most = DENSE_PREFILL_MAX if self.pass_set.dense else QUANTIZED_PREFILL_MAX
        if self.pass_set.layer_fn is quantized_layer and (n <= most or self.int8):
            return self.forward(tokens, positions, positions, keys, values, last_only, taps=taps)
        idx = (torch.zeros_like(positions), positions)
        keys, values = [k[:, :, :n] for k in keys], [v[:, :, :n] for v in values]
        return self._body(tokens, positions, idx, keys, values, None, last_only, self.prefill_set, None, taps, below=n)

    @property
    def exact(self) -> str:
        """"bitwise" where this device's kernels are proven width-invariant (``proves_invariance``,
        once), else "near-ties": speculative text may part from plain decoding at a rounding near-tie.
        A compiled forward fuses its own kernels, which the checks do not see: near-ties."""
        if self._proven is None:
            self._proven = not self.compiled and self.proves_invariance()
        return "bitwise" if self._proven else "near-ties"

    @torch.no_grad()
    def proves_invariance(self, layers: tuple = (0,)) -> bool:
        """Whether rows of a verify block, of a token tree and of a batch get the very logits of
        one-token steps, through this model's own weights on this device (random tokens; the first
        decoder layer and the LM head, so it costs a few one-layer passes and one prefill a row)."""
        dev, layers = self.device, list(layers)
        g = torch.Generator().manual_seed(3)
        P, W = 70, 12
        toks = torch.randint(self.embed.num_embeddings, (2, P + W), generator=g).to(dev)

        def run(rows, prompt_lens, block, positions, tree=None, one_by_one=False):
            keys, values = self.new_cache(len(rows), 256)
            for b, (r, n) in enumerate(zip(rows, prompt_lens)):
                self.prefill(toks[r : r + 1, :n], [k[b : b + 1] for k in keys], [v[b : b + 1] for v in values])
            if one_by_one:
                return torch.cat([self.forward(block[:, i : i + 1], positions[:, i : i + 1], positions[:, i : i + 1],
                                               keys, values, layers=layers) for i in range(block.shape[1])], 1)
            write_at = positions if tree is None else positions[:, :1] + torch.arange(block.shape[1], device=dev)
            return self.forward(block, positions, write_at, keys, values, layers=layers, tree=tree)

        steps = torch.arange(P, P + W, device=dev)[None]
        alone = run([0], [P], toks[:1, P:], steps, one_by_one=True)[0]
        same = torch.equal(run([0], [P], toks[:1, P:], steps)[0], alone)
        # the same block beside a row with another prompt (its own length) in a batch
        other = torch.arange(P - 9, P - 9 + W, device=dev)[None]
        same &= torch.equal(run([1, 0], [P - 9, P], torch.cat([toks[1:, P - 9 : P - 9 + W], toks[:1, P:]]),
                                torch.cat([other, steps]))[1], alone)
        # a token tree: the block's tokens as one path, each node with a sibling beside it
        parents, tokens, path = [-1], [int(toks[0, P])], [0]
        for i in range(1, W):
            for sibling in (False, True):
                parents.append(path[-1])
                tokens.append(int(toks[1, i]) if sibling else int(toks[0, P + i]))
            path.append(len(tokens) - 2)
        n = len(tokens)
        vis = torch.eye(n, dtype=torch.bool)
        depth = [0] * n
        for t in range(1, n):
            vis[t] |= vis[parents[t]]
            depth[t] = depth[parents[t]] + 1
        got = run([0], [P], torch.tensor([tokens], device=dev), P + torch.tensor([depth], device=dev),
                  tree=vis[None].to(dev))[0]
        return bool(same and torch.equal(got[path], alone))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., head_dim] of ``positions``, in the model's dtype (HF's rotary tables)."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    def rotary(self, positions: torch.Tensor, below: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, w, 1, head_dim] of ``positions`` [B, w], every one below ``below``. On a CPU
        they are rows of a table made once (doubled as texts grow): two index ops a pass instead of
        ten (~40 us of a 4 ms step), each row the very values ``_rope`` gives that position (one
        elementwise formula); on a GPU, computed in the pass (CUDA graphs capture it)."""
        if positions.device.type != "cpu":
            cos, sin = self._rope(positions)
        else:
            self._rotary_table = position_table(self._rotary_table, below, self._rope, positions.device)
            cos, sin = self._rotary_table[0][positions], self._rotary_table[1][positions]
        return cos[:, :, None], sin[:, :, None]

    def _body(self, tokens, positions, idx, keys, values, layout: KeyLayout | None, last_only: bool, mm: _MatmulSet,
              layers=None, taps: tuple = (), *, below: int):
        """``below``: every position is below it (the slots the pass reads)."""
        attend = None if layout is None else PassAttention(self.attention, layout, self.scaling, self.head_dim)
        whole = mm.all_layers is not None and layers is None and getattr(attend, "kernel", False)
        if whole and mm.all_layers().whole_passes:  # embeddings to logits in one call
            self._rotary_table = position_table(self._rotary_table, below, self._rope, positions.device)
            out = mm.all_layers().run_pass(tokens, positions, self._rotary_table, keys, values, idx[1], attend.layout,
                                           self.scaling, taps, last_only)
            return out if taps else out[0]
        h = self.embed(tokens)
        cos, sin = self.rotary(positions, below)
        tapped = {}
        if whole:
            inner = tuple(i for i in taps if i < self.n_layers)  # the last "tap" is the normed output, below
            h, inputs = mm.all_layers()(h, cos, sin, keys, values, idx[1], attend.layout, self.scaling, inner)  # one call
            tapped = dict(zip(inner, inputs.unbind(2)))
        else:
            if idx[0] is None:  # each block position's row, for the cache writes' advanced indexing
                idx = (torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand(tokens.shape), idx[1])
            for i in range(self.n_layers) if layers is None else layers:
                if i in taps:
                    tapped[i] = h
                h = mm.layer_fn(h, cos, sin, attend, idx, keys[i], values[i], mm.layers[i], self.n_heads, self.n_kv,
                                self.head_dim, self.eps, self.scaling, self.gqa)
        h = mm.final_norm(h) if mm.final_norm else _rms_norm(h, self.norm.weight, self.eps, mm.layers[0].get("norm_rows"))
        logits = mm.head(h[:, -1:].contiguous() if last_only else h)  # contiguous: see KVState.append
        if not taps:
            return logits
        tapped[self.n_layers] = h
        return logits, torch.stack([tapped[i] for i in taps], 2)


def _packed(fast: "FastLlama", plain: list[dict], compute: torch.dtype, hint: int):
    """oneDNN-packed copies of every matmul weight (layers and the lm_head) computing in ``compute``.
    q/k/v and gate/up are packed as one matrix each (fewer, wider matmuls stream faster: ~2.5 ms
    of a 27 ms bf16 step on an AVX-512 CPU) where that keeps each part's bits: always in float32,
    whose promise is greedy output; in bf16, whose plain decoding is HF's bit for bit, where
    ``stacking_is_exact`` finds it so on this CPU (else HF's separate matmuls)."""
    groups, first = [], plain[0]  # every layer has the first one's shapes
    for group in (("q", "k", "v"), ("gate", "up")):
        exact = compute == torch.float32 or cpu_kernels.stacking_is_exact(
            compute, first[group[0]].shape[1], tuple(first[n].shape[0] for n in group),
            any(n + "_bias" in first for n in group), hint)
        groups += [group] if exact else [(n,) for n in group]
    layers = []
    for w in plain:
        w = dict(w)
        for group in groups + [("o",), ("down",)]:
            w["".join(group) + "_packed"] = PackedLinear.stacked([w[n] for n in group],
                                                                 [w.get(n + "_bias") for n in group], compute, hint)
        layers.append(w)
    head = fast.lm_head
    if head.bias is None:
        head = PackedLinear(head.weight, None, compute, hint)
    return layers, head


def _quantized(fast: "FastLlama", plain: list[dict], qweights: dict[str, QuantWeight | DenseWeight]):
    """Every matmul of the passes after the prefill over the GGUF's own quantized weights
    (``quantized``), q/k/v and gate/up each one matmul (each output is its own dot product in
    that kernel, so stacking changes no bits); a matmul without quantized weights stays F.linear.
    Returns (layers, head, the kernels' name)."""
    layers, dense = [], 0
    for i, w in enumerate(plain):
        w = dict(w)
        for group, module in ((("q", "k", "v"), "self_attn.{}_proj"), (("gate", "up"), "mlp.{}_proj"),
                              (("o",), "self_attn.{}_proj"), (("down",), "mlp.{}_proj")):
            parts = [qweights.get(f"model.layers.{i}." + module.format(n)) for n in group]
            same = len({type(p) for p in parts}) == 1 and (
                isinstance(parts[0], PackedQ8) or len({p.bits for p in parts}) == 1)
            if all(p is not None for p in parts) and same:
                biases = [w.get(n + "_bias") for n in group]
                bias = None if all(b is None for b in biases) else torch.cat(
                    [b if b is not None else torch.zeros(p.shape[0]) for p, b in zip(parts, biases)])
                w["".join(group) + "_packed"] = QuantLinear(type(parts[0]).stacked(parts), bias, fast.int8)
                w.setdefault("quantized", {})["".join(group)] = w["".join(group) + "_packed"]  # unwindowed
            elif gguf_model.is_direct(fast.hf_model):  # no dense weights to fall back on
                raise SpeculantError(f"layer {i}'s {'/'.join(group)} mix dense and quantized GGUF types, which one "
                                     "kernel call cannot take: load the model with dtype float32")
            else:  # F.linear over the dense weights, windowed like the rest
                dense += len(group)
                for n in group:
                    w[n + "_packed"] = FLinear(w[n], w.get(n + "_bias"))
        layers.append(w)
    if "lm_head" in qweights:
        head = QuantLinear(qweights["lm_head"], fast.lm_head.bias, fast.int8)
    else:
        dense += 1
        head = FLinear(fast.lm_head.weight, fast.lm_head.bias)
    k = quantized.kernels()
    if all(q.bits in (16, 32) for q in qweights.values()):
        held = " over its weights' bfloat16 values" if any(q.bits == 16 for q in qweights.values()) else ""
        return layers, head, f"float32 on the kernel core{held} ({k.isa()})"
    mode = "q8 (int8 activations" if fast.int8 else "quantized (float32 activations"
    return layers, head, f"{mode}; {quantized.describe(qweights, dense)}; {k.isa() if k else 'PyTorch ops'})"


def _matmul_bytes(layers: list[dict], head) -> int:
    weights = [w[n] for w in layers for n in MATMULS] + [head.weight]
    return sum(t.numel() * t.element_size() for t in weights)


def cat_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The rows of two static caches [B, heads, slots, D] in one, as many slots as the larger."""
    out = a.new_zeros(a.shape[0] + b.shape[0], a.shape[1], max(a.shape[2], b.shape[2]), a.shape[3])
    out[: a.shape[0], :, : a.shape[2]] = a
    out[a.shape[0] :, :, : b.shape[2]] = b
    return out


@functools.lru_cache(maxsize=64)
def _columns(width: int, device: torch.device) -> torch.Tensor:
    """[1, width] 0..width-1: a block's columns, made once per width (a small op saved a pass: they
    run cold after a pass has streamed the weights). Read only, never written."""
    return torch.arange(width, device=device)[None]


@functools.lru_cache(maxsize=64)
def _causal(width: int) -> list[list[bool]]:
    """A causal block's visibility as lists (query t sees slots 0..t). Read only, never written."""
    return [[s <= t for s in range(width)] for t in range(width)]


class StaticKVState(PerRow):
    """KVState's interface over a static cache: ``lengths`` pointers, ``rollback`` moves them.

    ``compile`` wraps the forward in ``torch.compile`` (CUDA graphs on GPU via reduce-overhead);
    shapes stay static because the cache is allocated once at ``size`` slots.
    """

    def __init__(self, fast: FastLlama, cache: tuple[list, list], step=None):
        self.fast = fast
        self.keys, self.values = cache
        batch_size, self.size = self.keys[0].shape[0], self.keys[0].shape[2]
        self.ptr = torch.zeros(batch_size, dtype=torch.long, device=fast.device)
        self.step = step or fast.forward
        self.started = False  # the first append is the prompts' prefill

    def block_width(self, width: int, room: int) -> int:
        """Draft columns to verify for ``width`` used ones: padded to a few widths when the forward
        replays captured CUDA graphs (a cache shared across requests), else ``width``."""
        pad = getattr(self.step, "block_width", None)
        return pad(width, room) if pad is not None else width

    def lengths(self) -> torch.Tensor:
        return self.ptr  # never written in place (each change makes a new tensor): no copy needed

    @torch.no_grad()
    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, last_only: bool = False,
               layers: list[int] | None = None, tree: tuple | None = None, taps: tuple = ()):
        """Run the block after each row's pointer and advance it. ``layers``: only these decoder
        layers run and write their K/V (a self-speculative draft step; eager, never graphed).
        ``tree``: (position offsets [B, w], visibility [B, w, w]) of a token-tree block (tree.py).
        ``taps``: also return these layers' hidden states (FastLlama.forward)."""
        B, w = tokens.shape
        if tree is not None:
            offsets, vis = tree
            if all(block == _causal(w) for block in vis.tolist()):
                vis = None  # every row's tree a chain: the causal block's attention, the same bits (~10 us a layer less)
            write_at = self.ptr[:, None] + _columns(w, tokens.device)
            if int(write_at.max()) >= self.size:
                raise RuntimeError("static KV cache is full")  # sized by the engine; a bug if reached
            logits = self.step(tokens, self.ptr[:, None] + offsets, write_at, self.keys, self.values, last_only,
                               tree=vis, taps=taps)
            self.ptr = self.ptr + w
            return logits
        if valid is None:  # every column real (a one-token step's positions: the pointers, no op)
            n_real, positions = w, self.ptr[:, None] if w == 1 else self.ptr[:, None] + _columns(w, tokens.device)
        else:
            col = _columns(w, tokens.device)
            n_real = valid.sum(1)
            # inputs are right-aligned (left padding): real column t of row b is token t-(w-n_b)
            offset = col - (w - n_real[:, None])
            # pad columns go past the real ones, where no real query can see them
            positions = torch.where(offset >= 0, self.ptr[:, None] + offset, self.ptr[:, None] + n_real[:, None] + col)
        if int(positions.max()) >= self.size:
            raise RuntimeError("static KV cache is full")  # sized by the engine; a bug if reached
        if layers is None and not self.started:
            logits = self._prefill(tokens, n_real.tolist() if valid is not None else [w] * B, last_only, taps)
        elif layers is None:
            logits = self.step(tokens, positions, positions, self.keys, self.values, last_only, taps=taps)
        else:
            logits = self.fast.forward(tokens, positions, positions, self.keys, self.values, last_only, layers)
        self.ptr = self.ptr + n_real
        return logits

    def _prefill(self, tokens, lengths: list[int], last_only: bool, taps: tuple):
        """Each row's prompt alone (FastLlama.prefill): its cache and first logits do not depend on
        the other prompts of the batch. A prompt that an earlier row holds too (n samples of one
        prompt) is computed once and its cache copied. Outputs are right-aligned, as the padded input was."""
        B, w = tokens.shape
        outs, first = [], {}
        for b, n in enumerate(lengths):
            prompt = tuple(tokens[b, w - n :].tolist())
            if prompt in first:
                a = first[prompt]
                for cache in (*self.keys, *self.values):
                    cache[b, :, :n] = cache[a, :, :n]
                outs.append(outs[a])
                continue
            first[prompt] = b
            rows = slice(b, b + 1)
            outs.append(self.fast.prefill(tokens[rows, w - n :], [k[rows] for k in self.keys],
                                          [v[rows] for v in self.values], last_only, taps))
        self.started = True

        def stack(parts):  # right-aligned in w columns (logits of the last token only: one column each)
            if all(p.shape[1] == parts[0].shape[1] for p in parts):
                return torch.cat(parts)
            return torch.cat([F.pad(p, (0, 0) * (p.dim() - 2) + (w - p.shape[1], 0)) for p in parts])

        if not taps:
            return stack(outs)
        return stack([o[0] for o in outs]), stack([o[1] for o in outs])

    def prefills_in_chunks(self) -> bool:
        """Whether prompts appended a chunk at a time give the very cache and logits of one prefill:
        where the prefill is the passes' own forward (q8: every prompt runs the int8 kernels, each
        row the same bits at any width, its keys read back from the cache as they were written)."""
        return self.fast.int8 and self.fast.pass_set.layer_fn is quantized_layer and self.step == self.fast.forward

    def rollback(self, lengths: torch.Tensor) -> None:
        self.ptr = torch.minimum(self.ptr, lengths.to(self.ptr.device))

    def keep_path(self, start: torch.Tensor, path: torch.Tensor, n: torch.Tensor) -> None:
        """After a tree pass written from slot ``start``: move the accepted nodes' K/V (block slots
        1 + path[:n]) next to the root, so the row's cache holds exactly root + accepted path."""
        ns = n.tolist()
        width = max(ns, default=0)
        in_place = all(row[:k] == list(range(k)) for row, k in zip(path[:, :width].tolist(), ns))
        if not in_place:  # else: the accepted nodes' keys and values are where the path puts them already
            steps = torch.arange(width, device=path.device)[None]
            dst = start[:, None] + 1 + steps
            src = torch.where(steps < n[:, None], start[:, None] + 1 + path[:, :width], dst)
            kernels = native.built() if path.device.type == "cpu" else None
            if kernels is not None:  # every layer's keys and values in one call
                kernels.move_slots([*self.keys, *self.values], src.contiguous(), dst.contiguous())
            else:
                rows = torch.arange(len(start), device=path.device)[:, None].expand(-1, width)
                for cache in (self.keys, self.values):
                    for layer in cache:
                        by_slot = layer.transpose(1, 2)  # [B, S, kv heads, D]: index slots per row
                        by_slot.index_put_((rows, dst), by_slot[rows, src])
        self.ptr = start + 1 + n

    row_fields = ("ptr",)  # the caches themselves move in place (PerRow)

    def _select_more(self, order: list[int]) -> None:
        if order == sorted(order):
            # keep the rows in place, moved up over the dropped ones: no new cache (a copy of every
            # layer's whole cache per finished row made batched decoding spend its time in the kernel)
            for i, r in enumerate(order):
                if r != i:  # r > i: read before any write reaches it
                    for cache in (*self.keys, *self.values):
                        cache[i].copy_(cache[r])
            n = len(order)
            self.keys, self.values = [k[:n] for k in self.keys], [v[:n] for v in self.values]
        else:
            rows = torch.tensor(order, dtype=torch.long, device=self.keys[0].device)
            self.keys = [k[rows] for k in self.keys]
            self.values = [v[rows] for v in self.values]

    def _join_more(self, other: "StaticKVState") -> None:
        """Append ``other``'s rows (a new cache holding both: the larger size, padded), a layer at a
        time: each layer's old tensors go as its new one is made, so the join holds one layer more
        than the larger of the caches before and after, not both whole. A cache either held of its
        backend's pool goes back to it (the joined state holds a cache of its own)."""
        for state in (self, other):
            if getattr(state, "pool", None) is not None:
                state.pool.release(state)
                state.pool = None
        self.keys, self.values = list(self.keys), list(self.values)  # never the backend's own lists
        theirs = (list(other.keys), list(other.values))
        other.keys = other.values = []
        for mine, their in zip((self.keys, self.values), theirs):
            for i in range(len(mine)):
                mine[i] = cat_rows(mine[i], their[i])
                their[i] = None
        self.size, self.step = self.keys[0].shape[2], self.fast.forward  # a cache of its own: no captured graphs
        self.cache_key = None

    def valid_kv(self, row: int, layer: int = 0):
        n = int(self.ptr[row])
        return self.keys[layer][row, :, :n], self.values[layer][row, :, :n]

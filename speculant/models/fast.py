"""The fast path for Llama-family models: our own compact forward over the model's weights and a
preallocated static KV cache with a length pointer per row (gpt-fast style).

- Rollback is moving a row's pointer back: rejected slots are simply overwritten later.
- Rows of a batch write at their own positions (scatter), so rows that accepted different numbers
  of tokens never leave holes; a query at position t sees exactly the slots 0..t of its row.
- Every step has static shapes (batch, block width, cache size), so the decode step and each
  (γ+1)-token verification step can be captured as CUDA graphs (``torch.compile``,
  mode="reduce-overhead") or compiled for the CPU.
- The math follows transformers' Llama modules op for op (float32 RMSNorm statistics, rotary
  tables cast to the activation dtype, SDPA attention), so greedy output matches ``generate``.

Supported: model types whose decoder layer is Llama's (llama, mistral without sliding window,
qwen2, smollm): see ``supports``. Anything else runs on the general path (``KVState``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

FAST_MODEL_TYPES = {"llama", "mistral", "qwen2"}


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def onednn_packing_available() -> bool:
    """oneDNN's prepacked linear (what torch.compile's CPU freezing uses) exists in this build."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


class PackedLinear:
    """A CPU weight reordered once into oneDNN's blocked layout. In bf16 the M=1..16 matmuls of
    decoding and verification then skip ``F.linear``'s per-call reorder (a 2-core EPYC streams the
    default model's lm_head at 26 GB/s instead of 11), with the same oneDNN kernels and fp32
    accumulation: the results are the same bits (checked against ``F.linear`` in the tests)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else bias.detach().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@contextlib.contextmanager
def _onednn_disabled():
    """aten's matmuls skip oneDNN meanwhile (torch.backends.mkldnn.flags, without its side warnings)."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


def _linear(x, w: dict, name: str):
    packed = w.get(name + "_packed")
    return packed(x) if packed is not None else F.linear(x, w[name], w.get(name + "_bias"))


def decoder_layer(h, cos, sin, mask, idx, k_cache, v_cache, w: dict, n_heads: int, n_kv: int, head_dim: int,
                  eps: float, scaling: float, causal: bool = False, gqa: bool = False):
    """One Llama decoder layer over a block of w tokens, writing its K/V into the static cache.

    A pure function of tensors (weights passed in), so ``torch.compile`` compiles it once and every
    layer reuses the same kernels: compile time does not grow with depth."""
    B, T, _ = h.shape
    x = _rms_norm(h, w["ln1"], eps)
    q = _linear(x, w, "q").view(B, T, n_heads, head_dim).transpose(1, 2)
    k = _linear(x, w, "k").view(B, T, n_kv, head_dim).transpose(1, 2)
    v = _linear(x, w, "v").view(B, T, n_kv, head_dim).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k_cache.scatter_(2, idx, k)
    v_cache.scatter_(2, idx, v)
    # mask None: a one-token step over exactly the live cache, or (causal) a prefill from position 0
    o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, is_causal=causal,
                                       scale=scaling, enable_gqa=gqa)
    h = h + _linear(o.transpose(1, 2).reshape(B, T, -1), w, "o")
    x = _rms_norm(h, w["ln2"], eps)
    return h + _linear(F.silu(_linear(x, w, "gate")) * _linear(x, w, "up"), w, "down")


class FastLlama:
    """A functional view of a transformers Llama-family CausalLM: shares its weights, no copies
    (except on CPU in bf16, where each matmul weight also gets a oneDNN-prepacked copy)."""

    def __init__(self, hf_model: torch.nn.Module, compile: bool = False, pack: bool | None = None):
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
        self.weights = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            w = {"ln1": layer.input_layernorm.weight, "q": a.q_proj.weight, "k": a.k_proj.weight,
                 "v": a.v_proj.weight, "o": a.o_proj.weight, "ln2": layer.post_attention_layernorm.weight,
                 "gate": m.gate_proj.weight, "up": m.up_proj.weight, "down": m.down_proj.weight}
            for name in ("q", "k", "v"):  # Qwen2 has q/k/v biases
                bias = getattr(a, f"{name}_proj").bias
                if bias is not None:
                    w[f"{name}_bias"] = bias
            self.weights.append(w)
        self.norm = inner.norm
        self.lm_head = hf_model.get_output_embeddings()
        self.inv_freq = inner.rotary_emb.inv_freq
        self.rope_scale = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.scaling = inner.layers[0].self_attn.scaling
        p = next(hf_model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # CPU + bf16: prepack every matmul weight for oneDNN (a second copy of the weights: for a
        # model that fits a laptop's memory twice, the 2-3x faster matmuls are worth it)
        cpu = self.device.type == "cpu"
        if pack is None:
            pack = cpu and self.dtype == torch.bfloat16
        self.packed = bool(pack) and cpu and onednn_packing_available()
        self.plain_weights = self.weights
        if self.packed:
            self.weights = [dict(w) for w in self.weights]
            for w in self.weights:
                for name in ("q", "k", "v", "o", "gate", "up", "down"):
                    w[name + "_packed"] = PackedLinear(w[name], w.get(name + "_bias"))
        self.head = PackedLinear(self.lm_head.weight) if self.packed and self.lm_head.bias is None else self.lm_head
        self.layer_fn = torch.compile(decoder_layer, dynamic=True) if compile else decoder_layer
        # compiled on CPU in bf16: one-token steps run the compiled layer over the unpacked weights
        # with PyTorch's own bf16 GEMV (fp32 accumulation), which streams these small matrices about
        # twice as fast as oneDNN; wider blocks keep the eager packed oneDNN matmuls, whose cost is
        # flat in the block width. The GEMV rounds otherwise than HF's oneDNN matmuls, so greedy text
        # can differ from HF bf16 at near-ties (a few bf16 steps); uncompiled, it is bit for bit HF's.
        # (The oneDNN switch is process-wide while a step runs: generation is not run concurrently.)
        self.native_gemv = bool(compile) and self.packed

    def new_cache(self, batch: int, size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (batch, self.n_kv, size, self.head_dim)
        keys = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layers)]
        values = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layers)]
        return keys, values

    def forward(self, tokens, positions, write_at, keys, values, last_only: bool = False, layers=None):
        """tokens/positions/write_at: [B, w]. Writes K/V of the block at ``write_at`` and attends,
        for each query, to the slots at or before its position. Returns logits [B, w or 1, V].
        ``layers``: run only these decoder layers (self-speculation); None = all."""
        B, w = tokens.shape
        S = keys[0].shape[2]
        plain = False  # no mask: SDPA's causal prefill or one-token step, the very call HF makes
        if tokens.device.type == "cpu":
            # attend over the live part of the cache only (a view): attention work follows the text's
            # length, not the cache's size. On GPU shapes stay static for CUDA graphs.
            end = int(positions.max()) + 1
            plain = B == 1 and (w == 1 or w == end) and int(positions[0, 0]) == end - w
            S = min(S, end if plain else -(-end // 64) * 64)
            keys, values = [k[:, :, :S] for k in keys], [v[:, :, :S] for v in values]
        mask = None
        if not plain:
            visible = torch.arange(S, device=tokens.device)[None, None, None, :] <= positions[:, None, :, None]
            # an additive float mask: several times faster than a boolean one in CPU SDPA kernels
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=tokens.device).masked_fill(~visible, float("-inf"))
        idx = write_at[:, None, :, None].expand(B, self.n_kv, w, self.head_dim)
        causal = mask is None and w > 1  # a prefill from position 0
        if self.native_gemv and w == 1 and layers is None:
            with _onednn_disabled():
                return self._body(tokens, positions, idx, keys, values, mask, last_only, causal, packed=False)
        return self._body(tokens, positions, idx, keys, values, mask, last_only, causal, layers)

    def _body(self, tokens, positions, idx, keys, values, mask, last_only: bool, causal: bool, layers=None,
              packed: bool = True):
        h = self.embed(tokens)
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(h.dtype)[:, None]
        sin = (emb.sin() * self.rope_scale).to(h.dtype)[:, None]
        weights = self.weights if packed else self.plain_weights
        layer_fn = decoder_layer if self.native_gemv and packed else self.layer_fn  # packed: eager oneDNN
        for i in range(self.n_layers) if layers is None else layers:
            h = layer_fn(h, cos, sin, mask, idx, keys[i], values[i], weights[i], self.n_heads, self.n_kv,
                         self.head_dim, self.eps, self.scaling, causal, self.gqa)
        if last_only:
            h = h[:, -1:]
        return (self.head if packed else self.lm_head)(_rms_norm(h, self.norm.weight, self.eps))


class StaticKVState:
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

    def lengths(self) -> torch.Tensor:
        return self.ptr.clone()

    @torch.no_grad()
    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, last_only: bool = False,
               layers: list[int] | None = None):
        """Run the block after each row's pointer and advance it. ``layers``: only these decoder
        layers run and write their K/V (a self-speculative draft step; eager, never graphed)."""
        B, w = tokens.shape
        if valid is None:
            n_real = torch.full((B,), w, dtype=torch.long, device=tokens.device)
        else:
            n_real = valid.sum(1)
        # inputs are right-aligned (left padding): real column t of row b is token t-(w-n_b)
        col = torch.arange(w, device=tokens.device)[None, :]
        offset = col - (w - n_real[:, None])
        real = offset >= 0
        # pad columns go past the real ones, where no real query can see them
        positions = torch.where(real, self.ptr[:, None] + offset, self.ptr[:, None] + n_real[:, None] + col)
        if int(positions.max()) >= self.size:
            raise RuntimeError("static KV cache is full")  # sized by the engine; a bug if reached
        if layers is None:
            logits = self.step(tokens, positions, positions, self.keys, self.values, last_only)
        else:
            logits = self.fast.forward(tokens, positions, positions, self.keys, self.values, last_only, layers)
        self.ptr = self.ptr + n_real
        return logits

    def rollback(self, lengths: torch.Tensor) -> None:
        self.ptr = torch.minimum(self.ptr, lengths.to(self.ptr.device))

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.ptr = self.ptr[rows]

    def valid_kv(self, row: int, layer: int = 0):
        n = int(self.ptr[row])
        return self.keys[layer][row, :, :n], self.values[layer][row, :, :n]

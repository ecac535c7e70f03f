"""Building blocks of the trained drafters' networks (speculators' layer layout and parameter names).

Plain tensors and ``nn.Linear``s: RMSNorm, rotary embeddings, attention with an explicit mask over
given keys/values (a context, a KV cache, or earlier training-time-test steps), the gated MLP, a
decoder layer, and logits over a draft vocabulary mapped back to the target's ids.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SpeculantError


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin [B, 1, T, D] for positions [B, T]: computed once per forward and shared by
    every layer's queries and keys (a drafting step is small enough that these ops show)."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) of x [B, heads, T, D] with ``rope``'s cos and sin (cast
    to x's dtype: under autocast a projection's output is narrower than the weights)."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention; Qwen3-style (RMSNorm on each head's q and k: DFlash) or Llama-style
    (``qk_norm=False``: EAGLE-3). ``in_dim``: the input width (EAGLE-3's first layer reads [token
    embedding, hidden state], twice the hidden size)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, bias: bool = False,
                 qk_norm: bool = True, in_dim: int | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim or hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim or hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim or hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    stacked_qkv = None  # cpu_kernels.pack_linears: q, k and v projected by one packed matmul

    def queries(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        """Rotated (normed) queries [B, heads, T, D] of x [B, T, in] (``cos_sin``: ``rope`` of its positions)."""
        return self._queries(self.q_proj(x), cos_sin)

    def keys_values(self, x: torch.Tensor, cos_sin):
        """Rotated, normed keys and values [B, kv_heads, T, D] of x [B, T, in] (``cos_sin`` as ``queries``)."""
        return self._keys_values(self.k_proj(x), self.v_proj(x), cos_sin)

    def _queries(self, q: torch.Tensor, cos_sin) -> torch.Tensor:
        B, T, _ = q.shape
        return rotate(self.q_norm(q.view(B, T, self.heads, self.head_dim)).transpose(1, 2), cos_sin)

    def _keys_values(self, k: torch.Tensor, v: torch.Tensor, cos_sin):
        B, T, _ = k.shape
        k = self.k_norm(k.view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        return rotate(k, cos_sin), v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Queries [B, heads, T, D] over keys/values [B, kv, S, D] with mask [B, 1, T, S] (True or 0:
        attend) -> [B, T, hidden]."""
        gqa = self.kv_heads != self.heads
        if gqa and q.is_cuda and mask is not None:
            # CUDA's fused kernels take a mask only without enable_gqa (with it, sdpa falls back to the
            # math kernel, which materialises every score: training-time test's masks are wide)
            k, v = (x.repeat_interleave(self.heads // self.kv_heads, 1) for x in (k, v))
            gqa = False
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))

    def forward(self, x, cos_sin, kv, mask):
        """x [B, T, in] (``cos_sin``: ``rope`` of its positions) attends to ``kv(k, v)``: the keys/values
        its own k, v join (a context before them, a KV cache they are written into), under mask [B, 1, T, S]."""
        if self.stacked_qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.stacked_qkv(x).split([self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2, -1)
        k, v = self._keys_values(k, v, cos_sin)
        return self.attend(self._queries(q, cos_sin), *kv(k, v), mask)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    stacked_gate_up = None  # cpu_kernels.pack_linears: gate and up projected by one packed matmul

    def forward(self, x):
        if self.stacked_gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.stacked_gate_up(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class Layer(nn.Module):
    """A pre-norm decoder layer; ``cfg`` a transformer_layer_config (model_type qwen3: q/k norms)."""

    def __init__(self, cfg: dict, in_dim: int | None = None):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        head_dim = cfg.get("head_dim") or H // cfg["num_attention_heads"]
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(H, cfg["num_attention_heads"], cfg.get("num_key_value_heads") or
                                   cfg["num_attention_heads"], head_dim, eps, bool(cfg.get("attention_bias", False)),
                                   qk_norm=cfg.get("model_type", "qwen3") == "qwen3", in_dim=in_dim)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, cfg["intermediate_size"])

    def forward(self, h, cos_sin, kv, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos_sin, kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def rope_theta(cfg: dict) -> float:
    """The drafter layers' rotary base; only plain rotary embeddings (rope_type default) are built."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise SpeculantError(f"this drafter uses rope_type {kind!r}; speculant builds default rotary "
                             "embeddings only")
    return float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def inv_freq(cfg: dict) -> torch.Tensor:
    """Rotary inverse frequencies of a transformer_layer_config (default rope only)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 1.0 / rope_theta(cfg) ** (torch.arange(0, head_dim, 2).float() / head_dim)


def vocab_logits(hidden: torch.Tensor, lm_head: nn.Module | None, d2t: torch.Tensor | None, target_head: nn.Module,
                 vocab: int) -> torch.Tensor:
    """Logits over the target's vocabulary [.., V]: the target's LM head (``lm_head`` None), or a
    draft-vocabulary head scattered into a -inf row (q is zero outside the draft vocabulary: still
    lossless; draft index i is target id i + d2t[i])."""
    hidden = hidden.contiguous()  # a strided slice (a block's [:, 1:]) would make a frozen head a bmm over copies
    if lm_head is None:
        return target_head(hidden.to(target_head.weight.dtype)).float()
    small = lm_head(hidden.to(lm_head.weight.dtype)).float()
    out = small.new_full((*small.shape[:-1], vocab), float("-inf"))
    ids = torch.arange(small.shape[-1], device=small.device) + d2t
    return out.index_copy_(out.dim() - 1, ids, small)


def to_draft(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """Target id -> draft index (-100: not in the draft vocabulary, ignored by the loss)."""
    index = torch.full((vocab,), -100, dtype=torch.long)
    ids = torch.arange(d2t.shape[0]) + d2t.cpu()
    index[ids] = torch.arange(d2t.shape[0])
    return index


def copy_target_head(lm_head: nn.Linear | None, target_head: nn.Module, d2t: torch.Tensor | None) -> None:
    """A draft LM head starts as the target's own rows of its tokens (all of them: the full vocabulary)."""
    if lm_head is not None:
        rows = torch.arange(lm_head.weight.shape[0]) + (d2t if d2t is not None else 0)
        lm_head.weight.copy_(target_head.weight[rows])

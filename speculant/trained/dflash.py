"""The DFlash block drafter network (Chen et al. 2026, arXiv 2602.06036), as speculators defines it.

A few decoder layers (Qwen3-style attention: RMSNorm on each head's q and k) that draft a whole
block in ONE forward. The target's hidden states from a few tapped layers, concatenated, go
through ``fc`` and ``hidden_norm`` into a *context*; every layer attends from the block's queries
to the context (keys/values projected from it, for the positions before the block) and to the
block itself, without a causal mask. The block is [last accepted token, MASK, ..., MASK]; the
final norm and an LM head (the target's, or a smaller one over a draft vocabulary) read the
draft tokens at slots 1..K-1. Embeddings and the full LM head are the target's, frozen.

Parameter names are speculators' (``fc``, ``hidden_norm``, ``layers.i.self_attn.q_proj`` ...,
``norm``, ``lm_head`` with a draft vocabulary, buffers ``d2t``/``t2d``), so a folder saved from here
loads in speculators and vLLM, and theirs load here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) of x [B, heads, T, D] at positions [B, T]."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * emb.cos().to(x.dtype) + rotated * emb.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
        """Rotated, normed keys and values [B, kv_heads, T, D] of x [B, T, H] at positions [B, T]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, positions, inv_freq), v

    def forward(self, x, positions, inv_freq, ctx_k, ctx_v, mask):
        """Block x [B, K, H] at positions [B, K] attends to context keys/values [B, kv, C, D] and to
        itself; mask [B, 1, K, C + K] (True: attend)."""
        B, K, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, K, self.heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, positions, inv_freq)
        k, v = self.keys_values(x, positions, inv_freq)
        k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(o.transpose(1, 2).reshape(B, K, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        head_dim = cfg.get("head_dim") or H // cfg["num_attention_heads"]
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(H, cfg["num_attention_heads"], cfg.get("num_key_value_heads") or
                                   cfg["num_attention_heads"], head_dim, eps, bool(cfg.get("attention_bias", False)))
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, cfg["intermediate_size"])

    def forward(self, h, positions, inv_freq, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), positions, inv_freq, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def rope_theta(cfg: dict) -> float:
    """The drafter layers' rotary base; only plain rotary embeddings (rope_type default) are built."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        from ..errors import SpeculantError

        raise SpeculantError(f"this DFlash drafter uses rope_type {kind!r}; speculant builds default rotary "
                             "embeddings only")
    return float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


class DFlashNet(nn.Module):
    """``cfg``: the speculators config dict (``transformer_layer_config``, ``aux_hidden_state_layer_ids``,
    ``block_size``, ``mask_token_id``, ``draft_vocab_size``, ``target_hidden_size``)."""

    def __init__(self, cfg: dict):
        super().__init__()
        tl = cfg["transformer_layer_config"]
        H = tl["hidden_size"]
        target_hidden = cfg.get("target_hidden_size") or H
        self.taps = tuple(cfg["aux_hidden_state_layer_ids"])
        self.block_size = int(cfg["block_size"])
        self.mask_token_id = int(cfg["mask_token_id"])
        self.fc = nn.Linear(len(self.taps) * target_hidden, H, bias=False)
        self.hidden_norm = RMSNorm(H, tl.get("rms_norm_eps", 1e-6))
        self.layers = nn.ModuleList([Layer(tl) for _ in range(tl["num_hidden_layers"])])
        self.norm = RMSNorm(H, tl.get("rms_norm_eps", 1e-6))
        head_dim = tl.get("head_dim") or H // tl["num_attention_heads"]
        theta = rope_theta(tl)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)
        vocab, draft_vocab = tl["vocab_size"], cfg.get("draft_vocab_size") or tl["vocab_size"]
        self.draft_vocab = draft_vocab != vocab
        self.lm_head = nn.Linear(H, draft_vocab, bias=False) if self.draft_vocab else None
        # draft id i is target id i + d2t[i] (speculators' convention); t2d marks the kept target ids
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long) if self.draft_vocab else None)
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool) if self.draft_vocab else None)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """Target hidden states [B, T, len(taps), Ht] -> the drafter's context [B, T, H]."""
        return self.hidden_norm(self.fc(aux.flatten(2).to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys/values the block attends to for context ctx [B, T, H] at positions [B, T]."""
        return [layer.self_attn.keys_values(ctx, positions, self.inv_freq) for layer in self.layers]

    def block(self, embeds: torch.Tensor, positions: torch.Tensor, kv, mask: torch.Tensor) -> torch.Tensor:
        """The block's final hidden states [B, K, H] (before the LM head)."""
        h = embeds.to(self.fc.weight.dtype)
        for layer, (k, v) in zip(self.layers, kv):
            h = layer(h, positions, self.inv_freq, k, v, mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, target_head: nn.Module, vocab: int) -> torch.Tensor:
        return vocab_logits(hidden, self.lm_head if self.draft_vocab else None, self.d2t, target_head, vocab)


def vocab_logits(hidden: torch.Tensor, lm_head: nn.Module | None, d2t: torch.Tensor | None, target_head: nn.Module,
                 vocab: int) -> torch.Tensor:
    """Logits over the target's vocabulary [.., V]: the target's LM head (``lm_head`` None), or a
    draft-vocabulary head scattered into a -inf row (q is zero outside the draft vocabulary: still
    lossless; draft index i is target id i + d2t[i])."""
    if lm_head is None:
        return target_head(hidden.to(target_head.weight.dtype)).float()
    small = lm_head(hidden.to(lm_head.weight.dtype)).float()
    out = small.new_full((*small.shape[:-1], vocab), float("-inf"))
    ids = torch.arange(small.shape[-1], device=small.device) + d2t
    return out.index_copy_(out.dim() - 1, ids, small)

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
from torch import nn

from .blocks import Layer, RMSNorm, inv_freq, rope, vocab_logits


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
        self.register_buffer("inv_freq", inv_freq(tl), persistent=False)
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
        cos_sin = rope(positions, self.inv_freq, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos_sin) for layer in self.layers]

    def block(self, embeds: torch.Tensor, positions: torch.Tensor, kv, mask: torch.Tensor) -> torch.Tensor:
        """The block's final hidden states [B, K, H] (before the LM head)."""
        h = embeds.to(self.fc.weight.dtype)
        cos_sin = rope(positions, self.inv_freq, h.dtype)
        for layer, (ctx_k, ctx_v) in zip(self.layers, kv):
            h = layer(h, cos_sin, after(ctx_k, ctx_v), mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, target_head: nn.Module, vocab: int) -> torch.Tensor:
        return vocab_logits(hidden, self.lm_head if self.draft_vocab else None, self.d2t, target_head, vocab)


def after(ctx_k: torch.Tensor, ctx_v: torch.Tensor):
    """The block's own keys/values follow the context's."""
    return lambda k, v: (torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2))

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

Training (``DFlashTrainer``, the hooks ``speculant train --kind dflash`` calls): random anchors in
each answer, each block filled in one forward, cross-entropy against the target's choices.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import Layer, RMSNorm, inv_freq, rope, to_draft, vocab_logits
from .data import Features
from .format import SPECULATORS_VERSION, layer_config, speculators_config, target_fingerprint
from .losses import GreedyRuns


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


def dflash_config(target: torch.nn.Module, target_name: str, layers: int, taps: list[int], block_size: int,
                  mask_token_id: int, draft_vocab_size: int | None = None) -> dict:
    """A speculators DFlash config for ``target``: draft layers of the target's width (Qwen3-style
    attention, as speculators builds them), the target's rope, tapped layer ids, block size."""
    layer_cfg = layer_config(target, layers, "qwen3")
    vocab = layer_cfg["vocab_size"]
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_cfg,
        "aux_hidden_state_layer_ids": list(taps),
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "draft_vocab_size": draft_vocab_size or vocab,
        "target_hidden_size": target.config.hidden_size,
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "tie_word_embeddings": False,
        "speculators_config": speculators_config("dflash", block_size - 1, target, target_name),
        "speculant_target": target_fingerprint(target),
    }


def pick_mask_token(tokenizer, vocab: int) -> int:
    """A token the text never uses, as the block's MASK: an 'unused' token if the vocabulary has one,
    else the last added special token that is not BOS/EOS/PAD/UNK or a chat-template marker."""
    if tokenizer is None:
        return vocab - 1
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    unused = sorted(i for i, t in added.items() if "unused" in str(t))
    if unused:
        return unused[0]
    template = str(getattr(tokenizer, "chat_template", "") or "")
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    free = [i for i, t in added.items() if i not in taken and str(t) not in template and i < vocab]
    return max(free) if free else vocab - 1


class DFlashTrainer:
    """The loss and the held-out evaluation of a DFlash network on cached features."""

    def __init__(self, net: DFlashNet, embed, target_head, vocab: int, anchors: int, decay: float = 4.0):
        self.net, self.embed, self.target_head, self.vocab = net, embed, target_head, vocab
        self.anchors, self.decay = anchors, decay
        K = net.block_size
        self.weights = torch.exp(-torch.arange(K - 1, dtype=torch.float32) / decay)
        self.to_draft = to_draft(net.d2t, vocab) if net.draft_vocab else None

    def _blocks(self, f: Features, anchors: int, rng: random.Random):
        K, T = self.net.block_size, len(f.ids)
        first = max(f.loss_from - 1, 0)
        candidates = list(range(first, T - K + 1))
        if not candidates:
            return None
        chosen = sorted(rng.sample(candidates, min(anchors, len(candidates))))
        return torch.tensor(chosen)

    def forward(self, f: Features, anchors: torch.Tensor):
        """Logits [A, K-1, V or draft V] of every anchor's block, and the target's choices [A, K-1]."""
        net, K = self.net, self.net.block_size
        dev = net.fc.weight.device
        T, A = len(f.ids), len(anchors)
        ctx = net.context(f.hidden[None].to(dev))
        kv = net.context_kv(ctx, torch.arange(T, device=dev)[None])
        kv = [(k.expand(A, -1, -1, -1), v.expand(A, -1, -1, -1)) for k, v in kv]
        steps = torch.arange(K)
        positions = (anchors[:, None] + steps[None]).to(dev)
        block = torch.full((A, K), net.mask_token_id, dtype=torch.long)
        block[:, 0] = f.ids[anchors]
        sees = torch.cat([torch.arange(T)[None] < anchors[:, None], torch.ones(A, K, dtype=torch.bool)], 1)
        hidden = net.block(self.embed(block.to(dev)).detach(), positions, kv, sees[:, None, None].to(dev))
        h = hidden[:, 1:].contiguous()  # a strided slice would make a frozen head a bmm over A copies of it
        logits = net.lm_head(h) if net.draft_vocab else self.target_head(h)
        labels = f.labels[(anchors[:, None] + steps[None, 1:] - 1)]  # slot j: the target's choice after a+j-1
        return logits.float(), labels.to(dev)

    def loss(self, f: Features, rng: random.Random):
        anchors = self._blocks(f, self.anchors, rng)
        if anchors is None:
            return None, 0
        logits, labels = self.forward(f, anchors)
        targets = labels if self.to_draft is None else self.to_draft.to(labels.device)[labels]
        per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100)
        w = self.weights.to(per.device).repeat(len(anchors)) * (targets.flatten() != -100)
        return (per * w).sum() / w.sum().clamp_min(1e-6), len(anchors) * (self.net.block_size - 1)

    @torch.no_grad()
    def evaluate(self, features: list[Features], rng: random.Random) -> dict:
        """α per slot and τ = 1 + mean accepted run (greedy verification of each block)."""
        runs = GreedyRuns(self.net.block_size - 1, self.net.d2t if self.net.draft_vocab else None)
        for f in features:
            anchors = self._blocks(f, 64, rng)
            if anchors is not None:
                runs.add(*self.forward(f, anchors))
        return runs.result("blocks")


def training_config(target, verifier: str, s, taps: list[int], draft_size: int) -> dict:
    """``speculant train --kind dflash``: the config of a network for ``target`` (a LoadedModel)."""
    return dflash_config(target.model, verifier, s.layers, taps, s.block_size,
                         pick_mask_token(target.tokenizer, target.vocab_size), draft_size)


def trainer(net: DFlashNet, target, s) -> DFlashTrainer:
    model = target.model
    return DFlashTrainer(net, model.get_input_embeddings(), model.get_output_embeddings(), target.vocab_size,
                         s.anchors)

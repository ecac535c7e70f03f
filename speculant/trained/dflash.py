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

from ..errors import SpeculantError
from .blocks import Layer, RMSNorm, inv_freq, rope, to_draft, vocab_logits
from .data import Features
from .format import SPECULATORS_VERSION, layer_config, speculators_config, target_fingerprint
from .losses import GreedyRuns, as_batch, mean_of_sequences


class DFlashNet(nn.Module):
    """``cfg``: the speculators config dict (``transformer_layer_config``, ``aux_hidden_state_layer_ids``,
    ``block_size``, ``mask_token_id``, ``draft_vocab_size``, ``target_hidden_size``)."""

    def __init__(self, cfg: dict):
        super().__init__()
        tl = cfg["transformer_layer_config"]
        if "sliding_attention" in (tl.get("layer_types") or []):
            raise SpeculantError("this DFlash folder has sliding-window draft layers, which speculant does not build: "
                                 "use one whose transformer_layer_config has only full_attention layers")
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
    """The loss and the held-out evaluation of a DFlash network: ``loss`` on one sequence's cached
    features, ``loss_batch`` on right-padded sequences (the target's states computed on the fly:
    tools/train_batched.py), both one forward for every block: random anchors in each answer, each
    block [token, MASK, ...] attending to its sequence's context before the anchor and to itself."""

    def __init__(self, net: DFlashNet, embed, target_head, vocab: int, anchors: int, decay: float = 4.0):
        self.net, self.embed, self.target_head, self.vocab = net, embed, target_head, vocab
        self.anchors, self.decay = anchors, decay
        K = net.block_size
        self.weights = torch.exp(-torch.arange(K - 1, dtype=torch.float32) / decay)
        self.to_draft = to_draft(net.d2t, vocab) if net.draft_vocab else None

    def _anchors(self, lengths: torch.Tensor, loss_from: torch.Tensor, count: int, rng: random.Random):
        """Up to ``count`` random anchors in each sequence's answer, sorted, as [B, A] (rows padded
        with anchor 0) and which of them are real [B, A]; (None, None) if no sequence has one."""
        K, chosen = self.net.block_size, []
        for T, lf in zip(lengths.tolist(), loss_from.tolist()):
            candidates = list(range(max(lf - 1, 0), T - K + 1))
            chosen.append(sorted(rng.sample(candidates, min(count, len(candidates)))) if candidates else [])
        A = max(map(len, chosen))
        if not A:
            return None, None
        return (torch.tensor([c + [0] * (A - len(c)) for c in chosen]),
                torch.tensor([[True] * len(c) + [False] * (A - len(c)) for c in chosen]))

    def forward(self, ids, aux, labels, anchors, real):
        """Logits [N, K-1, V or draft V] of the real anchors' blocks, the target's choices [N, K-1]
        and each block's sequence [N]. ids [B, T], aux [B, T, taps, Ht], labels [B, T] (right-padded),
        anchors and real [B, A]: one forward, each sequence's A blocks side by side."""
        net, K = self.net, self.net.block_size
        dev = net.fc.weight.device
        ids, labels, anchors, real = ids.to(dev), labels.to(dev), anchors.to(dev), real.to(dev)
        (B, T), A = ids.shape, anchors.shape[1]
        kv = net.context_kv(net.context(aux.to(dev)), torch.arange(T, device=dev)[None])
        at = anchors[..., None] + torch.arange(K, device=dev)  # [B, A, K] positions
        block = torch.full((B, A, K), net.mask_token_id, dtype=torch.long, device=dev)
        block[..., 0] = ids.gather(1, anchors)
        sees = (torch.arange(T, device=dev) < anchors[..., None])[:, :, None].expand(B, A, K, T).reshape(B, A * K, T)
        own = torch.eye(A, dtype=torch.bool, device=dev).repeat_interleave(K, 0).repeat_interleave(K, 1)
        mask = torch.cat([sees, own.expand(B, -1, -1)], -1)[:, None]  # a block sees its context and itself
        hidden = net.block(self.embed(block.flatten(1)).detach(), at.flatten(1), kv, mask)
        h = hidden.view(B, A, K, -1)[:, :, 1:][real]  # [N, K-1, H], contiguous: a frozen head stays one matmul
        logits = net.lm_head(h) if net.draft_vocab else self.target_head(h)
        want = labels.gather(1, (at[..., 1:] - 1).flatten(1)).view(B, A, K - 1)[real]  # slot j: after a+j-1
        return logits.float(), want, real.nonzero()[:, 0]

    def loss(self, f: Features, rng: random.Random):
        return self.loss_batch(*as_batch(f, self.net.fc.weight.device), rng=rng)

    def loss_batch(self, ids, aux, final, loss_from, lengths, labels=None, rng=None):
        """The mean over B right-padded sequences of each one's loss: cross-entropy of every slot of
        ``self.anchors`` random blocks against the target's choices ``labels``, slot j weighted
        exp(-(j-1)/decay). ``final`` is not read. Returns (loss or None if no sequence has a block,
        slots judged)."""
        anchors, real = self._anchors(lengths, loss_from, self.anchors, rng)
        if anchors is None:
            return None, 0
        logits, labels, seq = self.forward(ids, aux, labels, anchors, real)
        targets = labels if self.to_draft is None else self.to_draft.to(labels.device)[labels]
        per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100)
        w = self.weights.to(per.device) * (targets != -100)
        return mean_of_sequences(per.view(targets.shape) * w, w, seq), targets.numel()

    @torch.no_grad()
    def evaluate(self, features: list[Features], rng: random.Random) -> dict:
        """α per slot and τ = 1 + mean accepted run (greedy verification of each block)."""
        runs = GreedyRuns(self.net.block_size - 1, self.net.d2t if self.net.draft_vocab else None)
        for f in features:
            ids, aux, _, loss_from, lengths, labels = as_batch(f, self.net.fc.weight.device)
            anchors, real = self._anchors(lengths, loss_from, 64, rng)
            if anchors is not None:
                runs.add(*self.forward(ids, aux, labels, anchors, real)[:2])
        return runs.result("blocks")


def settings_of(cfg: dict) -> dict:
    """The options a network's config was made with (to train it further in batches)."""
    return {"layers": cfg["transformer_layer_config"]["num_hidden_layers"], "block_size": int(cfg["block_size"])}


def training_config(target, verifier: str, s, taps: list[int], draft_size: int) -> dict:
    """``speculant train --kind dflash``: the config of a network for ``target`` (a LoadedModel)."""
    return dflash_config(target.model, verifier, s.layers, taps, s.block_size,
                         pick_mask_token(target.tokenizer, target.vocab_size), draft_size)


def trainer(net: DFlashNet, target, s) -> DFlashTrainer:
    model = target.model
    return DFlashTrainer(net, model.get_input_embeddings(), model.get_output_embeddings(), target.vocab_size,
                         s.anchors)

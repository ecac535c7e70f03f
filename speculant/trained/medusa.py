"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state.

Head k turns the final normed hidden state at position t (the one whose logits gave token t+1)
into a guess of token t+1+k: a stack of residual blocks (x + SiLU(W x + b), W initialised to zero
so a fresh head starts as the target's own next-token guess) read through an LM head: the
target's, frozen and not stored, or one shared draft-vocabulary head (the N tokens the target
produces most, FR-Spec style; q is zero outside it, still lossless). The heads do not see each
other's guesses, so the drafter offers a token *tree* (several candidates per depth, best-first
by the product of head probabilities) and the target keeps the longest path it agrees with.

On disk: ``config.json`` (``speculators_model_type: "medusa"``, speculant's own: speculators has no
Medusa model) + ``model.safetensors``. Training: ``MedusaTrainer`` (``speculant train --kind medusa``).
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import copy_target_head, to_draft, vocab_logits
from .data import Features
from .format import target_fingerprint
from .losses import GreedyRuns, as_batch, mean_of_sequences


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaNet(nn.Module):
    """``cfg``: ``hidden_size``, ``num_heads``, ``num_hidden_layers`` (residual blocks per head),
    ``vocab_size`` and ``draft_vocab_size`` (equal: the target's LM head)."""

    def __init__(self, cfg: dict):
        super().__init__()
        H, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
        self.num_heads = int(cfg["num_heads"])
        self.taps = tuple(cfg["aux_hidden_state_layer_ids"])  # (the target's layer count,): its final normed state
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(H) for _ in range(int(cfg.get("num_hidden_layers", 1)))])
                                   for _ in range(self.num_heads))
        self.draft_vocab = draft_vocab != vocab
        self.lm_head = nn.Linear(H, draft_vocab, bias=False) if self.draft_vocab else None
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long) if self.draft_vocab else None)
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool) if self.draft_vocab else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., H] final hidden states -> [.., K, H]: head k's state for the token k+1 after the next."""
        h = hidden.to(self.heads[0][0].linear.weight.dtype)
        return torch.stack([head(h) for head in self.heads], -2)

    def logits(self, states: torch.Tensor, target_head: nn.Module, vocab: int) -> torch.Tensor:
        return vocab_logits(states, self.lm_head, self.d2t, target_head, vocab)


def medusa_config(target: nn.Module, target_name: str, heads: int, layers: int, draft_vocab_size: int) -> dict:
    c = target.config
    vocab = int(target.get_output_embeddings().weight.shape[0])
    return {
        "architectures": ["MedusaDraftModel"],
        "speculators_model_type": "medusa",
        "hidden_size": c.hidden_size,
        "num_heads": heads,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size or vocab,
        "aux_hidden_state_layer_ids": [c.num_hidden_layers],
        # what check_target reads of every kind
        "transformer_layer_config": {"hidden_size": c.hidden_size, "vocab_size": vocab},
        "speculators_config": {"algorithm": "medusa",
                               "verifier": {"name_or_path": target_name,
                                            "architectures": list(getattr(c, "architectures", None) or [])}},
        "speculant_target": target_fingerprint(target),
    }


class MedusaTrainer:
    """The loss and the held-out evaluation of Medusa heads: head j at position t learns the
    target's token t+2+j (labels[t+1+j]), weighted 0.8^j as Medusa does; ``loss`` on one sequence's
    cached features, ``loss_batch`` on right-padded sequences (tools/train_batched.py). The heads
    read only the target's final normed states."""

    def __init__(self, net: MedusaNet, target_head, vocab: int):
        self.net, self.target_head, self.vocab = net, target_head, vocab
        K = net.num_heads
        self.weights = 0.8 ** torch.arange(K, dtype=torch.float32)
        self.to_draft = to_draft(net.d2t, vocab) if net.draft_vocab else None

    def forward(self, final, labels, loss_from, lengths):
        """Logits [N, K, V or draft V] at every answer position t of each right-padded sequence
        (final [B, T, H], labels [B, T]; t from its answer start - 1 to its length - 2), the target's
        tokens there [N, K] (-100 past the sequence's end) and each position's sequence [N]."""
        K, dev = self.net.num_heads, self.net.heads[0][0].linear.weight.device
        final, labels, loss_from, lengths = final.to(dev), labels.to(dev), loss_from.to(dev), lengths.to(dev)
        T = final.shape[1]
        t = torch.arange(T, device=dev)[None]
        b, t = ((t >= (loss_from - 1).clamp_min(0)[:, None]) & (t < (lengths - 1)[:, None])).nonzero(as_tuple=True)
        states = self.net(final[b, t].float())
        logits = self.net.lm_head(states) if self.net.draft_vocab else self.target_head(states)
        at = t[:, None] + 1 + torch.arange(K, device=dev)[None]
        labels = torch.where(at < lengths[b, None], labels[b[:, None], at.clamp(max=T - 1)], torch.full_like(at, -100))
        return logits.float(), labels, b

    def loss(self, f: Features, rng: random.Random):
        return self.loss_batch(*as_batch(f, self.net.heads[0][0].linear.weight.device), rng=rng)

    def loss_batch(self, ids, aux, final, loss_from, lengths, labels=None, rng=None):
        """The mean over B right-padded sequences of each one's loss (the weighted cross-entropy of
        every head at every answer position against the target's choices ``labels``); ``aux`` is not
        read. Returns (loss or None if no sequence has a position to learn, positions judged)."""
        logits, labels, seq = self.forward(final, labels, loss_from, lengths)
        if not len(seq):
            return None, 0
        targets = labels if self.to_draft is None else torch.where(
            labels >= 0, self.to_draft.to(labels.device)[labels.clamp_min(0)], labels)
        per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100)
        w = self.weights.to(per.device) * (targets != -100)
        return mean_of_sequences(per.view(targets.shape) * w, w, seq), logits.shape[0]

    @torch.no_grad()
    def evaluate(self, features: list[Features], rng: random.Random) -> dict:
        """Per head, α = how often its top-1 guess is the target's token, given the heads before it
        were right; τ = 1 + mean run of right guesses (the greedy chain of top-1 guesses; the tree
        the drafter offers does better)."""
        runs = GreedyRuns(self.net.num_heads, self.net.d2t if self.net.draft_vocab else None)
        for f in features:
            _, _, final, loss_from, lengths, labels = as_batch(f, self.net.heads[0][0].linear.weight.device)
            logits, labels, seq = self.forward(final, labels, loss_from, lengths)
            if len(seq):
                runs.add(logits, labels)
        return runs.result("positions")


def settings_of(cfg: dict) -> dict:
    """The options the heads' config was made with (to train them further in batches)."""
    return {"heads": int(cfg["num_heads"]), "layers": int(cfg.get("num_hidden_layers", 1))}


def training_config(target, verifier: str, s, taps: list[int], draft_size: int) -> dict:
    """``speculant train --kind medusa``: the config of heads for ``target`` (a LoadedModel); they
    read its final normed state, not ``taps``."""
    return medusa_config(target.model, verifier, s.heads, s.layers, draft_size)


def init_from_target(net: MedusaNet, target, d2t) -> None:
    copy_target_head(net.lm_head, target.model.get_output_embeddings(), d2t)


def trainer(net: MedusaNet, target, s) -> MedusaTrainer:
    return MedusaTrainer(net, target.model.get_output_embeddings(), target.vocab_size)

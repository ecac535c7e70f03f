"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state.

Head k turns the final normed hidden state at position t (the one whose logits gave token t+1)
into a guess of token t+1+k: a stack of residual blocks (x + SiLU(W x + b), W initialised to zero
so a fresh head starts as the target's own next-token guess) read through an LM head: the
target's, frozen and not stored, or one shared draft-vocabulary head (the N tokens the target
produces most, FR-Spec style; q is zero outside it, still lossless). The heads do not see each
other's guesses, so the drafter offers a token *tree* (several candidates per depth, best-first
by the product of head probabilities) and the target keeps the longest path it agrees with.

On disk: ``config.json`` (``speculators_model_type: "medusa"``, speculant's own: speculators has no
Medusa model) + ``model.safetensors``.
"""
from __future__ import annotations

import torch
from torch import nn

from .blocks import vocab_logits


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
    from .format import target_fingerprint

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

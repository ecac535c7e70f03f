"""``dflash2:DIR``, ``dspark:DIR``, ``xpress:DIR`` (and ``trained:DIR``): speculators' DFlash variants
(trained/dflash_family.py) draft a block in one forward of their backbone, as ``dflash`` does, and
choose each slot's token given the drafts before it:

- dflash2: the selector's greedy path over each slot's top-k (one-hot q);
- dspark: each slot's logits plus the Markov bias of the draft before it, picked from the processed
  distribution q of that sum (q of a slot given the earlier drafts: verification stays exact);
  with ``sample_from_anchor`` (its default) the anchor's slot drafts too, so a block drafts K tokens;
- xpress: the refiner's Jacobi passes over the block's argmax drafts (one-hot q).

speculant runs these folders and does not train them (speculators does).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..trained.dflash_family import DFlash2Net, DSparkNet, XPressNet, _draft_space
from ..trained.format import load_network
from .base import DraftContext, Proposal
from .dflash import DFlashDrafter
from .model import fit_vocab
from .spec import TrainedKind


def _one_hot(drafts: torch.Tensor) -> Proposal:
    B, n = drafts.shape
    return Proposal(drafts, torch.full((B,), n, dtype=torch.long, device=drafts.device))


class DFlash2Drafter(DFlashDrafter):
    name = "dflash2"

    def _drafts(self, hidden: torch.Tensor, gamma: int) -> Proposal:
        n = min(gamma, self.net.block_size - 1)
        return _one_hot(self.net.pick(hidden, self.pending, self.head, n))


class DSparkDrafter(DFlashDrafter):
    name = "dspark"

    def __init__(self, net: DSparkNet, target: torch.nn.Module, label: str = "dspark"):
        super().__init__(net, target, label)
        self.max_gamma = net.block_size if net.from_anchor else net.block_size - 1

    def _full(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [B, Vd] on the target's vocabulary (-inf outside it)."""
        net, V = self.net, self.ctx.vocab_size
        if not net.draft_vocab:
            return fit_vocab(draft_logits, V)
        out = draft_logits.new_full((draft_logits.shape[0], V), float("-inf"))
        return out.index_copy_(1, torch.arange(draft_logits.shape[-1], device=out.device) + net.d2t, draft_logits)

    def _drafts(self, hidden: torch.Tensor, gamma: int) -> Proposal:
        net, proc, dev = self.net, self.ctx.processing, self.ctx.device
        first = 0 if net.from_anchor else 1  # the first slot that drafts
        n = min(gamma, net.block_size - first)
        base = _draft_space(net, hidden, self.head)
        B = hidden.shape[0]
        drafts = torch.zeros(B, n, dtype=torch.long, device=dev)
        probs = [] if not proc.greedy else None
        prev, state = self.pending, None
        for k in range(first + n):  # the recurrent head's state runs through every slot from the block's first
            logits = base[:, k]
            if net.markov_head is not None:
                bias, state = net.markov_head.bias(prev, hidden[:, k], state)
                logits = logits + bias
            if k < first:
                continue
            j = k - first
            context = self.history.after(drafts[:, :j]) if self.history is not None else None
            tok, q = proc.pick(self._full(logits), context, self.ctx.generator, self.ctx.seeded, j)
            drafts[:, j] = prev = tok
            if probs is not None:
                probs.append(q)
        return Proposal(drafts, torch.full((B,), n, dtype=torch.long, device=dev),
                        torch.stack(probs, 1) if probs else None)


class XPressDrafter(DFlashDrafter):
    name = "xpress"

    def __init__(self, net: XPressNet, target: torch.nn.Module, label: str = "xpress"):
        super().__init__(net, target, label)
        self.max_gamma = net.block_size if net.from_anchor else net.block_size - 1

    def start(self, ctx: DraftContext) -> None:
        super().start(ctx)
        self.last = [p[-1] for p in ctx.prompts]  # per row: the newest token
        self.before = torch.tensor(self.last, dtype=torch.long, device=ctx.device)

    def update(self, new_tokens, n_accepted) -> None:
        # the token before the anchor (the anchor is the newest): the pass's second newest, else the last newest
        self.before = torch.tensor([t[-2] if len(t) > 1 else last for t, last in zip(new_tokens, self.last)],
                                   dtype=torch.long, device=self.ctx.device)
        self.last = [t[-1] for t in new_tokens]
        super().update(new_tokens, n_accepted)

    row_fields = DFlashDrafter.row_fields + ("before", "last")  # per-row state (PerRow)

    def _drafts(self, hidden: torch.Tensor, gamma: int) -> Proposal:
        first = 0 if self.net.from_anchor else 1
        n = min(gamma, self.net.block_size - first)
        return _one_hot(self.net.pick(hidden, self.pending, self.before, self.head)[:, first : first + n])


def _loader(net_cls, drafter_cls, what: str):
    def load(folder: str, target: torch.nn.Module, target_name: str, dtype=None):
        net = load_network(folder, target, target_name, net_cls, what, dtype,
                           ignore=("verifier_lm_head.", "verifier_norm.", "embed_tokens."))
        return drafter_cls(net, target, label=str(folder))
    return load


def _vllm_dspark(folder: str, cfg: dict, fixed: int | None) -> dict:
    block = cfg["block_size"] - (0 if cfg.get("sample_from_anchor", True) else 1)
    return {"method": "dspark", "model": str(Path(folder).resolve()), "num_speculative_tokens": min(fixed or block, block)}


def _refusal(kind: str) -> str:
    return (f"speculant train does not train {kind}: train it with speculators and run the folder here with "
            f"--drafter {kind}:DIR")


DFLASH2 = TrainedKind(
    name="dflash2", model_type="dflash2", network=DFlash2Net, load=_loader(DFlash2Net, DFlash2Drafter, "a DFlash2 network"),
    training_config=None, trainer=None, settings_of=lambda cfg: {}, vllm=None, train_refusal=_refusal("dflash2"),
    no_vllm="vLLM has no dflash2 method (its speculators loader maps dflash and dspark folders only): run it here",
    train_help="DFlash with block convolutions and a candidate selector (speculators trains it)")
DSPARK = TrainedKind(
    name="dspark", model_type="dspark", network=DSparkNet, load=_loader(DSparkNet, DSparkDrafter, "a DSpark network"),
    training_config=None, trainer=None, settings_of=lambda cfg: {}, vllm=_vllm_dspark, train_refusal=_refusal("dspark"),
    train_help="DFlash with a Markov bias from the draft before each slot (speculators trains it)")
XPRESS = TrainedKind(
    name="xpress", model_type="xpress", network=XPressNet, load=_loader(XPressNet, XPressDrafter, "an XPress network"),
    training_config=None, trainer=None, settings_of=lambda cfg: {}, vllm=None, train_refusal=_refusal("xpress"),
    no_vllm="vLLM has no xpress method: run it here",
    train_help="DFlash with a causal refiner resolved by Jacobi passes (speculators trains it)")

"""``peagle:DIR`` / ``trained:DIR``: a speculators P-EAGLE folder drafts a whole chain in one forward.

Each proposal feeds the head every (target states, next token) pair accepted since the last one
(into its KV cache, as ``eagle`` does) and, in the SAME forward, γ-1 mask slots after the last pair
(trained/peagle.py): the last pair's output drafts the first token, mask slot d the token d after
it. The slots' K/V lie past the accepted text's and are overwritten by the next proposal. Each draft
is picked from its slot's processed distribution q (greedy: the argmax); the slots do not read each
other's drafts, so q of a slot given the drafts before it is its own: verification stays exact.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..sampling import TokenHistory
from ..trained.format import default_taps, load_network, read_config, tensor_names
from ..trained.peagle import PEagleNet
from .base import DraftContext, Proposal, draft_slots
from .eagle import BEAM, DEPTH, EagleDrafter, joined_rows
from .spec import TrainedKind


def load_peagle(folder: str, target: torch.nn.Module, target_name: str, dtype=None) -> "PEagleDrafter":
    read_config(folder)
    own_embeddings = "embed_tokens.weight" in tensor_names(folder, "a P-EAGLE network")

    def build(cfg: dict) -> PEagleNet:
        taps = cfg.get("eagle_aux_hidden_state_layer_ids") or default_taps(target.config.num_hidden_layers)
        return PEagleNet({**cfg, "eagle_aux_hidden_state_layer_ids": taps}, own_embeddings)

    net = load_network(folder, target, target_name, build, "a P-EAGLE network", dtype,
                       ignore=("verifier_lm_head.", "verifier_norm."))
    return PEagleDrafter(net, target, label=str(folder))


class PEagleDrafter(EagleDrafter):
    name = "peagle"
    makes_trees = False
    block_drafts = True  # one forward drafts the chain

    def __init__(self, net: PEagleNet, target: torch.nn.Module, label: str = "peagle"):
        super().__init__(net, target, label)
        self.max_gamma = min(net.depths, (DEPTH - 1) * BEAM)  # mask slots fit the spare slots past the text

    def describe(self) -> str:
        return f"peagle:{self.label}"

    def start(self, ctx: DraftContext) -> None:
        super().start(ctx)
        proc = ctx.processing
        self.history = TokenHistory(ctx.prompts, ctx.vocab_size, ctx.device, proc) if proc.uses_context else None

    def update(self, new_tokens, n_accepted) -> None:
        super().update(new_tokens, n_accepted)
        if self.history is not None:
            self.history.extend(new_tokens)

    row_fields = EagleDrafter.row_fields + ("history",)  # per-row state (PerRow)

    def _full_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [.., V] (-inf outside the draft vocabulary)."""
        small = self.net.lm_head(normed).float()
        ids = self.net.target_ids(torch.arange(small.shape[-1], device=small.device))
        keep = ids < self.ctx.vocab_size
        out = small.new_full((*small.shape[:-1], self.ctx.vocab_size), float("-inf"))
        out[..., ids[keep]] = small[..., keep]
        return out

    @torch.no_grad()
    def propose(self, gamma: int) -> Proposal:
        net, dev = self.net, self.ctx.device
        n = max(1, min(gamma, self.max_gamma))
        counts = torch.tensor([len(t) for _, t in self.unfed], device=dev)
        B, m = len(self.unfed), int(counts.max())
        W = m + n - 1
        hidden = net.mask_features().to(dev)[None, None].expand(B, W, -1).clone()
        tokens = torch.full((B, W), net.mask_token_id, dtype=torch.long, device=dev)
        steps = torch.arange(W, device=dev)[None]
        for b, (f, t) in enumerate(self.unfed):
            if t:
                hidden[b, : len(t)] = net.features(joined_rows(f).to(dev))
                tokens[b, : len(t)] = torch.tensor(t, device=dev)
        # pair t of row b at position lengths + t; mask slot d after its last pair at lengths + count - 1 + d
        depth = steps - counts[:, None] + 1
        positions = torch.where(depth <= 0, self.lengths[:, None] + steps, self.lengths[:, None] + counts[:, None] - 1 + depth)
        real = depth < n  # past the mask slots: padding
        slots = torch.where(real & (counts[:, None] > 0), positions, self.spare)
        width = int((self.lengths + counts).max()) + n - 1
        mask = (torch.arange(width, device=dev)[None, None] <= positions[:, :, None])[:, None]
        _, normed = net.step(self.embed(tokens), hidden, positions,
                             [self._kv(i, slots, width) for i in range(len(net.layers))], mask)
        self.lengths = self.lengths + counts
        self.unfed = [([], []) for _ in self.unfed]
        at = (counts - 1).clamp_min(0)[:, None] + torch.arange(n, device=dev)[None]  # the last pair, then the masks
        logits = self._full_logits(normed.gather(1, at[..., None].expand(-1, -1, normed.shape[-1])))
        return draft_slots(self.ctx, self.history, logits, n)


def _vllm(folder: str, cfg: dict, fixed: int | None) -> dict:
    """vLLM's speculators loader maps a peagle folder to its parallel-drafting EAGLE-3 model, run by
    the eagle3 proposer (its method detection does not name peagle)."""
    depths = int((cfg.get("speculators_config", {}).get("proposal_methods") or [{}])[0].get("speculative_tokens") or 8)
    return {"method": "eagle3", "model": str(Path(folder).resolve()), "num_speculative_tokens": min(fixed or depths, depths)}


PEAGLE = TrainedKind(
    name="peagle", model_type="peagle", network=PEagleNet, load=load_peagle, training_config=None, trainer=None,
    settings_of=lambda cfg: {}, vllm=_vllm, taps_optional=True,
    train_refusal="speculant train does not train peagle (P-EAGLE learns from COD-sampled parallel groups): train "
                  "it with speculators and run the folder here with --drafter peagle:DIR",
    train_help="P-EAGLE, an EAGLE-3 head drafting a whole chain in one forward (speculators trains it)")

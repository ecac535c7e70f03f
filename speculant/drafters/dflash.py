"""``dflash:DIR``: a trained DFlash block drafter (speculators format) drafts a whole block per pass.

The target's verify pass returns the hidden states of the drafter's tapped layers at no extra pass;
those of every token the target cached (the prompt, then each pass's accepted tokens) become the
drafter's context, projected once into per-layer keys/values kept in a static cache. Each
proposal is ONE forward of the drafter over [last accepted token, MASK x (K-1)], read through the
target's LM head (or the drafter's draft-vocabulary head): K-1 draft tokens, each picked from the
processed distribution q of its slot (greedy: its argmax), so verification stays exact.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..sampling import TokenHistory
from ..trained import dflash as trained
from ..trained.dflash import DFlashNet
from ..trained.format import load_network
from .base import DraftContext, Drafter, Proposal, draft_slots
from .model import fit_vocab
from .spec import TrainedKind, TrainOption


def load_dflash(folder: str, target: torch.nn.Module, target_name: str, dtype=None) -> "DFlashDrafter":
    net = load_network(folder, target, target_name, DFlashNet, "a DFlash network", dtype)
    return DFlashDrafter(net, target, label=str(folder))


class DFlashDrafter(Drafter):
    name = "dflash"
    block_drafts = True  # one forward drafts the block: its cost is per pass, not per token

    def __init__(self, net: DFlashNet, target: torch.nn.Module, label: str = "dflash"):
        self.net, self.label = net, label
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        self.hidden_layers = net.taps
        self.max_gamma = net.block_size - 1

    def describe(self) -> str:
        return f"dflash:{self.label}"

    def state_bytes(self, rows: int, tokens: int) -> int:
        attn = self.net.layers[0].self_attn
        element = self.net.fc.weight.element_size()
        return 2 * len(self.net.layers) * rows * attn.kv_heads * tokens * attn.head_dim * element

    def start(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        B, dev = len(ctx.prompts), ctx.device
        size = ctx.max_tokens or max(len(p) for p in ctx.prompts) + 4096
        layer = self.net.layers[0].self_attn
        shape = (B, layer.kv_heads, size, layer.head_dim)
        dtype = self.net.fc.weight.dtype
        self.keys = [torch.zeros(shape, dtype=dtype, device=dev) for _ in self.net.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=dev) for _ in self.net.layers]
        self.lengths = torch.zeros(B, dtype=torch.long, device=dev)
        self.pending = torch.zeros(B, dtype=torch.long, device=dev)
        proc = ctx.processing
        self.history = TokenHistory(ctx.prompts, ctx.vocab_size, dev, proc) if proc.uses_context else None
        self._append(ctx.prompt_hidden)

    @torch.no_grad()
    def _append(self, hidden: list[torch.Tensor]) -> None:
        """Project the new context tokens' hidden states into each layer's keys/values."""
        counts = [h.shape[0] for h in hidden]
        width = max(counts, default=0)
        if width == 0:
            return
        B = len(hidden)
        aux = torch.zeros(B, width, *hidden[0].shape[1:], dtype=hidden[0].dtype, device=self.ctx.device)
        for b, h in enumerate(hidden):
            aux[b, : h.shape[0]] = h
        steps = torch.arange(width, device=self.ctx.device)[None]
        positions = self.lengths[:, None] + steps
        kv = self.net.context_kv(self.net.context(aux), positions)
        real = steps < torch.tensor(counts, device=self.ctx.device)[:, None]
        slots = torch.where(real, positions, self.keys[0].shape[2] - 1)  # padding lands in a spare slot
        idx = slots[:, None, :, None]
        for cache_k, cache_v, (k, v) in zip(self.keys, self.values, kv):
            cache_k.scatter_(2, idx.expand(-1, k.shape[1], -1, k.shape[3]), k)
            cache_v.scatter_(2, idx.expand(-1, v.shape[1], -1, v.shape[3]), v)
        self.lengths = self.lengths + torch.tensor(counts, device=self.ctx.device)

    def observe_hidden(self, hidden: list[torch.Tensor]) -> None:
        self._append(hidden)

    def update(self, new_tokens, n_accepted) -> None:
        self.pending = torch.tensor([t[-1] for t in new_tokens], dtype=torch.long, device=self.ctx.device)
        if self.history is not None:
            self.history.extend(new_tokens)

    # per-row state (PerRow); on a join, slot -1 takes padding: the larger cache's
    row_fields = ("lengths", "pending", "history")
    layer_fields = ("keys", "values")
    joins = True

    @torch.no_grad()
    def propose(self, gamma: int) -> Proposal:
        return self._drafts(self._block_hidden(), gamma)

    def _block_hidden(self) -> torch.Tensor:
        """ONE forward over each row's block [last accepted token, MASK, ...]: its states [B, K, H]."""
        B, K, dev = len(self.pending), self.net.block_size, self.ctx.device
        block = torch.full((B, K), self.net.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = self.pending
        steps = torch.arange(K, device=dev)[None]
        positions = self.lengths[:, None] + steps
        C = int(self.lengths.max())
        kv = [(k[:, :, :C], v[:, :, :C]) for k, v in zip(self.keys, self.values)]
        sees = torch.cat([torch.arange(C, device=dev)[None] < self.lengths[:, None], torch.ones(B, K, dtype=torch.bool,
                                                                                               device=dev)], 1)
        mask = sees[:, None, None, :].expand(B, 1, K, C + K)
        return self.net.block(self.embed(block), positions, kv, mask)

    def _drafts(self, hidden: torch.Tensor, gamma: int) -> Proposal:
        """Slots 1..γ's drafts, each picked from its processed distribution q."""
        logits = fit_vocab(self.net.logits(hidden[:, 1:], self.head, self.ctx.vocab_size), self.ctx.vocab_size)
        return draft_slots(self.ctx, self.history, logits, min(gamma, self.net.block_size - 1))


def _vllm(folder: str, cfg: dict, fixed: int | None) -> dict:
    block = cfg["block_size"]
    return {"method": cfg["speculators_model_type"], "model": str(Path(folder).resolve()),
            "num_speculative_tokens": min(fixed or block - 1, block - 1)}


DFLASH = TrainedKind(
    name="dflash", model_type="dflash", network=DFlashNet, load=load_dflash, training_config=trained.training_config,
    settings_of=trained.settings_of, trainer=trained.trainer, vllm=_vllm,
    train_help="a block drafter: one forward per block",
    options=(TrainOption("layers", 1, "drafter decoder layers"),
             TrainOption("block_size", 8, "tokens per drafted block (block - 1 drafts per pass)", minimum=2,
                         why="the anchor and at least one draft"),
             TrainOption("anchors", 48, "blocks per sequence per step")))

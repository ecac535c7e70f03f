"""speculators' DFlash variants, as it defines them: ``dflash2``, ``dspark`` and ``xpress``. Each is a
DFlash block drafter (``DFlashNet``: one forward over [anchor, MASK, ...] attending to the target's
tapped states) with something that makes a slot's draft depend on the drafts before it:

- ``DFlash2Net``: every layer wraps its attention and its MLP in token-conditioned grouped causal
  convolutions within the block (``GroupedConv``), and a bilinear candidate selector rescores each
  slot's top-k tokens by the draft before it (``pick``: greedy, slot after slot, from the anchor);
- ``DSparkNet``: a low-rank Markov logit bias from the previous token (``MarkovHead``: vanilla,
  gated or recurrent) added to each slot's logits; by default every slot, the anchor's too,
  predicts the token after it (``sample_from_anchor``); a confidence head (loaded, not used);
- ``XPressNet``: a causal refiner (``RefinerHead``) adds a bias from the previous token, the slot's
  state and the block's mean state, mixed causally over the block; the block is resolved by
  ``num_jacobi_passes`` parallel (Jacobi) passes over the argmax drafts.

Parameter names are speculators' (``layers.i.attention_conv.*``, ``candidate_selector.*``,
``markov_head.*``, ``confidence_head.*``, ``refiner_head.*``), so its folders load here. speculant runs
these folders; it does not train them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SpeculantError
from .blocks import Layer
from .dflash import DFlashNet


def grouped_conv(h: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block: int, group: int) -> torch.Tensor:
    """speculators' grouped dynamic causal convolution within blocks of ``block`` rows: h [N*block,
    H] flattened rows, delta [.., taps, groups] (per row), base [taps, H]: out_t = Σ_tap
    h_{t-tap} (base[tap] + delta_t[tap]), taps reaching before a block's first slot left out."""
    shape, H = h.shape, h.shape[-1]
    groups, taps = H // group, base.shape[0]
    flat = h.reshape(-1, groups, group)
    d = delta.reshape(-1, taps, groups)
    slot = torch.arange(flat.shape[0], device=h.device).remainder(block)
    out = torch.zeros_like(flat)
    for tap in range(taps):
        shifted = flat if tap == 0 else torch.cat([flat.new_zeros(tap, groups, group), flat[:-tap]])
        coefficient = base[tap].to(flat.dtype).view(1, groups, group) + d[:, tap, :, None]
        out = out + shifted * coefficient * slot.ge(tap).view(-1, 1, 1)
    return out.reshape(shape)


class GroupedConv(nn.Module):
    """The input-side and output-side convolutions around one sublayer, driven by one projection."""

    def __init__(self, hidden: int, block: int, taps: int, group: int):
        super().__init__()
        if hidden % group or taps > block:
            raise SpeculantError(f"a DFlash2 convolution of {taps} taps over groups of {group} does not fit hidden "
                                 f"size {hidden} and block size {block}")
        self.block, self.taps, self.group, self.groups = block, taps, group, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def prepare(self, h: torch.Tensor):
        kernels = self.kernel_projection(h).view(*h.shape[:-1], 2, self.taps, self.groups)
        return (grouped_conv(h, kernels[..., 0, :, :], self.base_kernel[0], self.block, self.group),
                kernels[..., 1, :, :])

    def finish(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_conv(h, delta, self.base_kernel[1], self.block, self.group)


class DFlash2Layer(Layer):
    def __init__(self, tl: dict, block: int, taps: int, group: int):
        super().__init__(tl)
        self.attention_conv = GroupedConv(tl["hidden_size"], block, taps, group)
        self.mlp_conv = GroupedConv(tl["hidden_size"], block, taps, group)

    def forward(self, h, cos_sin, kv, mask):
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, cos_sin, kv, mask), delta)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), delta)


def _draft_space(net: DFlashNet, hidden: torch.Tensor, target_head: nn.Module) -> torch.Tensor:
    """Logits over the draft vocabulary (the target's whole one without a draft head) [.., Vd]."""
    head = net.lm_head if net.draft_vocab else target_head
    return head(hidden.contiguous().to(head.weight.dtype)).float()


def to_target_ids(net: DFlashNet, draft_ids: torch.Tensor) -> torch.Tensor:
    return draft_ids + net.d2t[draft_ids] if net.draft_vocab else draft_ids


class DFlash2Net(DFlashNet):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        tl = cfg["transformer_layer_config"]
        if self.draft_vocab:
            raise SpeculantError("a DFlash2 network drafts over the target's whole vocabulary (its selector's codebooks)")
        taps, group = int(cfg.get("conv_kernel_size", 2)), int(cfg.get("conv_group_size", 16))
        self.layers = nn.ModuleList(DFlash2Layer(tl, self.block_size, taps, group) for _ in range(tl["num_hidden_layers"]))
        rank, vocab = int(cfg.get("selector_rank", 256)), tl["vocab_size"]
        self.top_k = int(cfg.get("selector_top_k", 16))
        self.candidate_selector = nn.Module()
        self.candidate_selector.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.candidate_selector.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.candidate_selector.hidden_projection = nn.Linear(tl["hidden_size"], rank, bias=False)

    def pick(self, hidden: torch.Tensor, anchor: torch.Tensor, target_head: nn.Module, n: int) -> torch.Tensor:
        """Drafts [B, n] for slots 1..n: each slot's top-k tokens by its logits, rescored by the
        selector given the draft before it (the anchor before slot 1), the best taken (greedy)."""
        sel = self.candidate_selector
        unary = _draft_space(self, hidden[:, 1 : n + 1], target_head)
        scores, candidates = unary.topk(min(self.top_k, unary.shape[-1]), -1)
        projected = sel.hidden_projection(hidden[:, 1 : n + 1].to(sel.hidden_projection.weight.dtype))
        prev, out = anchor, []
        for j in range(n):
            context = sel.predecessor_codebook[prev] * projected[:, j].to(sel.predecessor_codebook.dtype)
            edge = (context[:, None] * sel.successor_codebook[candidates[:, j]]).sum(-1).float()
            prev = candidates[:, j].gather(1, (scores[:, j] + edge).argmax(-1, keepdim=True)).squeeze(1)
            out.append(prev)
        return torch.stack(out, 1)


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int, kind: str):
        super().__init__()
        if kind not in ("vanilla", "gated", "rnn"):
            raise SpeculantError(f"a DSpark markov_head_type of {kind!r}: speculators defines vanilla, gated and rnn")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def bias(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """One slot's logit bias [B, Vd] given the token before it [B] and its state [B, H]; the
        recurrent kind carries a state [B, rank] from slot to slot (None: the block's first)."""
        e = self.markov_w1(prev).to(self.markov_w2.weight.dtype)
        if self.kind == "vanilla":
            return self.markov_w2(e).float(), state
        hidden = hidden.to(e.dtype)
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([hidden, e], -1))) * e).float(), state
        state = e.new_zeros(e.shape[0], self.rank) if state is None else state
        gate, candidate, out = self.joint_proj(torch.cat([state, e, hidden], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(out)).float(), state


class DSparkNet(DFlashNet):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        tl = cfg["transformer_layer_config"]
        H, vocab = tl["hidden_size"], tl["vocab_size"]
        draft_vocab = cfg.get("draft_vocab_size") or vocab
        self.from_anchor = bool(cfg.get("sample_from_anchor", True))
        rank = int(cfg.get("markov_rank", 256))
        self.markov_head = MarkovHead(vocab, draft_vocab, rank, H, cfg.get("markov_head_type", "vanilla")) if rank > 0 \
            else None
        if cfg.get("enable_confidence_head", True):  # its per-slot acceptance estimate: loaded, not used
            with_markov = bool(cfg.get("confidence_head_with_markov", True)) and rank > 0
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(H + (rank if with_markov else 0), 1)


class RefinerHead(nn.Module):
    def __init__(self, vocab: int, draft_vocab: int, hidden: int, block: int, rank: int, ratio: int):
        super().__init__()
        self.token_embed = nn.Embedding(vocab, rank)
        self.down_h = nn.Linear(hidden, rank, bias=False)
        self.down_g = nn.Linear(hidden, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(rank, block, block))
        self.mlp_gate = nn.Linear(rank, rank * ratio, bias=False)
        self.mlp_up = nn.Linear(rank, rank * ratio, bias=False)
        self.mlp_down = nn.Linear(rank * ratio, rank, bias=False)
        self.readout = nn.Linear(rank, draft_vocab, bias=False)
        self.register_buffer("causal_tril", torch.tril(torch.ones(block, block)), persistent=False)

    def hidden_cache(self, hidden: torch.Tensor) -> torch.Tensor:
        """[down_h(h) ; down_g(block mean of h)] [B, block, 2r]: the same for every pass."""
        h = hidden.to(self.down_h.weight.dtype)
        return torch.cat([self.down_h(h), self.down_g(h.mean(1, keepdim=True).expand_as(h))], -1)

    def bias(self, prev: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The block's logit bias [B, block, Vd] given each slot's previous token [B, block]."""
        x = self.in_proj(torch.cat([cache, self.token_embed(prev).to(cache.dtype)], -1))
        x = x + torch.einsum("ckj,njc->nkc", self.mix_l * self.causal_tril.to(self.mix_l.dtype), x)
        x = x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))
        return self.readout(x).float()


class XPressNet(DFlashNet):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        tl = cfg["transformer_layer_config"]
        vocab = tl["vocab_size"]
        self.from_anchor = bool(cfg.get("sample_from_anchor", False))
        self.passes = int(cfg.get("num_jacobi_passes", 6))
        self.refiner_head = RefinerHead(vocab, cfg.get("draft_vocab_size") or vocab, tl["hidden_size"], self.block_size,
                                        int(cfg.get("xpress_rank", 256)), int(cfg.get("xpress_mlp_ratio", 2)))

    def pick(self, hidden, anchor, before, target_head) -> torch.Tensor:
        """The block's drafts [B, block] (target ids) after the Jacobi passes: each pass biases every
        slot by the previous pass's draft before it (slot 0 the anchor; without sample_from_anchor
        slot 0 IS the anchor, and the token before it leads)."""
        base = _draft_space(self, hidden, target_head)
        cache = self.refiner_head.hidden_cache(hidden)
        pred = to_target_ids(self, base.argmax(-1))
        lead = anchor[:, None] if self.from_anchor else before[:, None]
        for _ in range(self.passes):
            if not self.from_anchor:
                pred[:, 0] = anchor
            pred = to_target_ids(self, (base + self.refiner_head.bias(torch.cat([lead, pred[:, :-1]], 1), cache)).argmax(-1))
        return pred

"""``eagle:DIR``: a trained EAGLE-3 head drafts a token tree over the target's own features (EAGLE-2's
dynamic tree).

The verify pass hands over the tapped hidden states of every token the target cached; paired with
the token that followed each (the accepted drafts and the target's own next token) they are the
head's input, fed once into its own KV cache at the start of the next proposal ("catch-up"). The
last pair's output state drafts the tree:

- depth 1: the head's ``TOP_K`` most probable tokens after the target's next token;
- each further depth expands the ``BEAM`` most probable nodes of the depth before (a node's score
  is the product of the head's probabilities along its path) in ONE forward of the head: each
  expanded node reads its own token and its parent's output state, attends to the accepted text
  and to its ancestors only, and offers its ``TOP_K`` most probable children;
- all nodes are ranked by score and listed best first (a child never outranks its parent), so any
  prefix is a tree and the engine keeps the nodes worth verifying. Deepening stops as soon as no
  node of the next depth could enter the best ``gamma`` (its parent already scores below them),
  which leaves the proposal unchanged and saves the forwards. Merged with prompt lookup
  (``propose_among``), the lookup chain's nodes count among those best ``gamma``: a strong chain
  ends the deepening sooner. (A chain node the tree also holds counts twice there, so deepening
  can end a depth early; that changes which nodes are drafted, never the output.)

The tree is a deterministic function of the accepted text (q one-hot), so greedy and sampled
verification both stay exact. Draft K/V live after the accepted text's and are overwritten by the
next catch-up: rolling back is moving a length.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..models import quantized
from ..models.cpu_kernels import pack_linears
from ..models.fast import position_table
from ..trained import eagle as trained
from ..trained.eagle import EagleNet
from ..trained.format import default_taps, load_network, read_config, tensor_names
from .base import DraftContext, Drafter, Proposal, seconds_since
from .spec import TrainedKind, TrainOption

TOP_K = 8  # children offered per expanded node
BEAM = 6  # nodes expanded per depth
DEPTH = 6  # deepest draft
# Stop deepening once no node of a depth is this likely. A node adds at most its parent's score in
# expected tokens, and a forward of the head costs ~1/8 of what a verified token saves (CPU, bf16:
# ~2 ms a step from cold cache, ~16 ms a token), so deepening below ~0.1 rarely pays. The value is
# from a side-by-side sweep (eagle+ngram, γ 8): 0.02 → 0.1 took drafting from 7.8-8.0 to 6.6 ms a
# pass for τ 2.30 → 2.28 (57.7-58.1 → 59.3 tok/s); higher values traded τ for no further speed.
MIN_SCORE = 0.1


def load_eagle(folder: str, target: torch.nn.Module, target_name: str, dtype=None) -> "EagleDrafter":
    read_config(folder)  # a folder that is not a drafter's fails on its config first
    own_embeddings = "embed_tokens.weight" in tensor_names(folder, "an EAGLE-3 network")

    def build(cfg: dict) -> EagleNet:  # speculators may leave the tapped layers to the target's depth
        taps = cfg.get("eagle_aux_hidden_state_layer_ids") or default_taps(target.config.num_hidden_layers)
        return EagleNet({**cfg, "eagle_aux_hidden_state_layer_ids": taps}, own_embeddings)

    net = load_network(folder, target, target_name, build, "an EAGLE-3 network", dtype)
    return EagleDrafter(net if quantized.drafts_on_kernels(target) else pack_linears(net), target, label=str(folder))


class KernelLayers:
    """The network's decoder layers through the CPU kernels, one call a layer (``eagle_layer`` for
    the first, ``layer`` for any after) where PyTorch ops take ~40: beside a target on the CPU kernels
    (``quantized.drafts_on_kernels``), whose kernels the network's linears already run on
    (``quantized.kernel_linears``). Attention masks become each query's visible slots in order (the
    kernel's ``slots`` and ``count``)."""

    def __init__(self, net: EagleNet):
        self.net, self.k = net, quantized.kernels()
        first = net.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.scale = self.head_dim ** -0.5  # scaled_dot_product_attention's
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # every position's, up to a length

    @staticmethod
    def fit(net: EagleNet) -> "KernelLayers | None":
        """KernelLayers for ``net`` where the kernels take its shapes and its linears are theirs, else None."""
        if quantized.kernels() is None:
            return None
        for layer in net.layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.stacked_qkv, a.o_proj.forward, m.stacked_gate_up, m.down_proj.forward)
            if not all(isinstance(x, quantized.QuantLinear) for x in linears) or not isinstance(a.q_norm, torch.nn.Identity):
                return None
            if a.head_dim % 16 or a.head_dim > 256 or layer.input_layernorm.weight.shape[0] % 16:
                return None
        return KernelLayers(net)

    def _args(self, layer) -> tuple:
        a, m = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = a.stacked_qkv, a.o_proj.forward, m.stacked_gate_up, m.down_proj.forward
        return ((qkv.args, qkv.weight.bits), (o.args, o.weight.bits), layer.post_attention_layernorm.weight,
                (gate_up.args, gate_up.weight.bits), (down.args, down.weight.bits))

    def chains(self, embed: torch.nn.Module) -> bool:
        """Whether ``chain`` takes this head: one layer, fc and the LM head on the kernels, no norm
        per tap, float32 embeddings."""
        net, w = self.net, getattr(embed, "weight", None)
        return (len(net.layers) == 1 and net.fc_norm is None
                and all(isinstance(m.forward, quantized.QuantLinear) for m in (net.fc, net.lm_head))
                and isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., head_dim] at ``positions`` (float32, as PyTorch's rotary computes them)."""
        freqs = positions[..., None].float() * self.net.inv_freq.float()
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos().contiguous(), emb.sin().contiguous()

    def chain(self, feats, tokens: list[int], starts: list[int], counts: list[int], spare: int, levels: int,
              budget: int, keys, values, embed_weight, outside) -> list[torch.Tensor]:
        """A whole proposal in one kernel call (``eagle_chain``): the catch-up block (the target's
        tapped states ``feats`` [B, W, taps, Ht] and the tokens after them, B * W in a list; row b's
        first ``counts[b]`` at positions and slots ``starts[b]`` + j, its padding written at slot
        ``spare``; its last pair drafts), then up to ``levels`` levels of a chain at slots and
        positions starts + counts + j - 1, and the ``budget`` most probable of its nodes and their
        siblings as a tree, best first. Returns (draft ids, log-probabilities [B, L, TOP_K]; the
        tree's target ids [B, n], lengths [B], parents [B, n], probabilities [B, n])."""
        below = max(s + c for s, c in zip(starts, counts)) + levels + feats.shape[1]  # the catch-up's and the chain's
        self._rope_table = position_table(self._rope_table, below, self.rope, feats.device)
        fc_args, layer_args, head_args = self._chain_weights(outside, embed_weight)
        return self.k.eagle_chain(feats.float().flatten(2).contiguous(), tokens, starts, counts, spare,
                                  *self._rope_table, levels, budget, *fc_args, *layer_args, keys[0], values[0],
                                  *head_args)

    def _chain_weights(self, outside, embed_weight) -> tuple[tuple, tuple, tuple]:
        """``eagle_chain``'s weight arguments, in three runs around the per-call ones (made once)."""
        made = getattr(self, "_chain_args", None)
        if made is None or made[0] is not outside or made[1] is not embed_weight:
            self._chain_args = (outside, embed_weight, self._weight_args(outside, embed_weight))
        return self._chain_args[2]

    def _weight_args(self, outside, embed_weight) -> tuple[tuple, tuple, tuple]:
        net = self.net
        layer = net.layers[0]
        (qkv, qb), (o, ob), ln2, (gu, gb), (down, db) = self._args(layer)
        fc, head, no = net.fc.forward, net.lm_head.forward, torch.empty(0)
        return ((no if net.input_norm is None else net.input_norm.weight.float(), fc.args, fc.weight.bits),
                (TOP_K, MIN_SCORE, layer.input_layernorm.weight.float(), layer.hidden_norm.weight.float(),
                 layer.input_layernorm.eps, layer.norm_before_residual, qkv, qb, self.heads, self.kv_heads,
                 self.head_dim),
                (self.scale, o, ob, ln2.float(), gu, gb, down, db, net.norm.weight.float(), net.norm.eps,
                 net.norm_output, head.args, head.weight.bits, net.d2t if net.draft_vocab else no.long(),
                 no if outside is None else outside, embed_weight))

    def step(self, embeds, hidden, positions, write_at, visible, keys, values):
        """``EagleNet.step`` with the keys each query sees given as ``visible`` [B, T, S] (bool)."""
        net, k = self.net, self.k
        cos, sin = self.rope(positions.expand(hidden.shape[:2]))  # a tree's depth: one position for a row's nodes
        count = visible.sum(-1)
        slots = torch.sort((~visible).to(torch.uint8), dim=-1, stable=True).indices  # the visible slots first, in order
        write_at = write_at.contiguous()
        h = hidden.float().contiguous()
        for i, layer in enumerate(net.layers):
            (qkv, qb), (o, ob), ln2, (gu, gb), (down, db) = self._args(layer)
            common = (cos, sin, self.heads, self.kv_heads, self.head_dim, keys[i], values[i], write_at, slots, count,
                      self.scale, o, ob, ln2.float(), gu, gb, down, db)
            ln1, eps = layer.input_layernorm.weight.float(), layer.input_layernorm.eps
            if i == 0:
                h = k.eagle_layer(embeds.float().contiguous(), h, ln1, layer.hidden_norm.weight.float(), eps,
                                  layer.norm_before_residual, qkv, qb, *common)
            else:
                h = k.layer(h, ln1, eps, qkv, qb, *common)
        normed = k.norm(h.contiguous(), net.norm.weight.float(), net.norm.eps).view(h.shape)
        return (normed if net.norm_output else h), normed


class EagleDrafter(Drafter):
    name = "eagle"
    makes_trees = True
    block_drafts = True  # a proposal costs a few forwards of one layer, whatever the tree's size

    def __init__(self, net: EagleNet, target: torch.nn.Module, label: str = "eagle"):
        self.net, self.label = net, label
        self.embed = net.embed_tokens if net.embed_tokens is not None else target.get_input_embeddings()
        self.hidden_layers = net.taps
        self.vocab = int(target.get_output_embeddings().weight.shape[0])
        draft_ids = net.target_ids(torch.arange(net.lm_head.weight.shape[0], device=net.lm_head.weight.device))
        outside = draft_ids >= self.vocab  # draft rows the target cannot emit (a head trained on a wider vocabulary)
        self.outside = outside if bool(outside.any()) else None
        self.kernel_layers = KernelLayers.fit(net) if quantized.drafts_on_kernels(target) else None
        # beside a target on the kernels a proposal is one kernel call: a chain and its levels' siblings
        self.chains = self.kernel_layers is not None and self.kernel_layers.chains(self.embed)

    @property
    def deepens_with_budget(self) -> bool:  # a chain costs a head step a level
        return self.chains

    @property
    def weighs_rivals(self) -> bool:  # the tree grown in PyTorch stops where rivals fill the budget; a chain does not
        return not self.chains

    def describe(self) -> str:
        return f"eagle:{self.label}"

    def state_bytes(self, rows: int, tokens: int) -> int:
        attn = self.net.layers[0].self_attn
        element = torch.finfo(self.net.dtype).bits // 8
        return 2 * len(self.net.layers) * rows * attn.kv_heads * (tokens + DEPTH * BEAM) * attn.head_dim * element

    def start(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        B, dev, net = len(ctx.prompts), ctx.device, self.net
        self.spare = (ctx.max_tokens or max(len(p) for p in ctx.prompts) + 4096) + (DEPTH - 1) * BEAM
        attn = net.layers[0].self_attn
        shape = (B, attn.kv_heads, self.spare + 1, attn.head_dim)  # slot `spare`: where padding is written
        self.keys = [torch.zeros(shape, dtype=net.dtype, device=dev) for _ in net.layers]
        self.values = [torch.zeros(shape, dtype=net.dtype, device=dev) for _ in net.layers]
        self.lengths = torch.zeros(B, dtype=torch.long, device=dev)
        # per row: (target features, next token) pairs not yet fed, and features still waiting
        # for the token after them (the last prompt token's: the target's first token); features
        # as lists of blocks of rows, joined when fed (a pass's two concatenations had cost ~0.1 ms,
        # a head switched off included, whose unfed features then grew each pass)
        self.feature_shape = ctx.prompt_hidden[0].shape[1:]  # [taps, hidden]
        self.unfed = [(_rows(h[:-1]), list(p[1:])) for h, p in zip(ctx.prompt_hidden, ctx.prompts)]
        self.waiting = [[h[-1:]] for h in ctx.prompt_hidden]
        self.first = True  # the first proposal feeds the prompts: a one-off (catchup_seconds)

    def observe_hidden(self, hidden: list[torch.Tensor]) -> None:
        self.waiting = [w + _rows(h) for w, h in zip(self.waiting, hidden)]

    def update(self, new_tokens, n_accepted) -> None:
        unfed, waiting = [], []
        for (feats, toks), blocks, new in zip(self.unfed, self.waiting, new_tokens):
            paired, rest = _split_rows(blocks, len(new))
            unfed.append((feats + paired, toks + list(new[: sum(b.shape[0] for b in paired)])))
            waiting.append(rest)
        self.unfed, self.waiting = unfed, waiting

    # per-row state (PerRow); caches of different sizes are padded to the larger on a join
    row_fields = ("lengths", "unfed", "waiting")
    layer_fields = ("keys", "values")
    joins = True

    def _join_more(self, other: "EagleDrafter") -> None:
        self.spare = max(self.spare, other.spare)  # the larger cache's last slot takes the padding

    def _step(self, embeds, hidden, positions, slots: torch.Tensor, width: int, mask: torch.Tensor):
        """One forward of the network for embeds, hidden [B, T, H] at positions [B, T]: its k/v
        written at ``slots`` [B, T], each query attending to the first ``width`` cache slots under
        ``mask`` [B, 1, T, width]. Returns (the state the next step reads, the normed state)."""
        if self.kernel_layers is not None:
            return self.kernel_layers.step(embeds, hidden, positions, slots, mask[:, 0], self.keys, self.values)
        return self.net.step(embeds, hidden, positions, [self._kv(i, slots, width) for i in range(len(self.net.layers))],
                             mask)

    def _kv(self, layer: int, slots: torch.Tensor, width: int):
        """Layer ``layer``'s keys/values callback: write the new k/v at ``slots`` [B, T], attend
        over the first ``width`` slots."""
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)

        def kv(k, v):
            self.keys[layer].transpose(1, 2).index_put_((rows, slots), k.transpose(1, 2))
            self.values[layer].transpose(1, 2).index_put_((rows, slots), v.transpose(1, 2))
            return self.keys[layer][:, :, :width], self.values[layer][:, :, :width]
        return kv

    def _unfed_block(self) -> tuple[list[int], torch.Tensor, list[int]]:
        """Every row's unfed pairs as one right-padded block, marked fed: (counts [B], the target's
        features [B, W, taps, Ht], the tokens after them, B * W in a list, 0 where padded)."""
        dev = self.ctx.device
        counts = [len(t) for _, t in self.unfed]
        W = max(max(counts), 1)
        if counts == [W]:  # one row, nothing to pad: its features as they are (a zeroed block and a copy ~60 us cold)
            feats = joined_rows(self.unfed[0][0]).to(dev, self.net.dtype)[None]
        else:
            feats = torch.zeros(len(counts), W, *self.feature_shape, dtype=self.net.dtype, device=dev)
            for b, (f, t) in enumerate(self.unfed):
                if t:
                    feats[b, : len(t)] = joined_rows(f).to(dev, self.net.dtype)
        tokens = [x for _, t in self.unfed for x in t + [0] * (W - len(t))]
        self.unfed = [([], []) for _ in self.unfed]
        return counts, feats, tokens

    def _unfed_pairs(self):
        """``_unfed_block`` as tensors: (counts [B], features [B, W, taps, Ht], tokens [B, W],
        positions [B, W], cache slots [B, W] (padding at the spare slot))."""
        dev = self.ctx.device
        lens, feats, tokens = self._unfed_block()
        W = feats.shape[1]
        starts = self.lengths.tolist()
        positions = torch.tensor([[s + j for j in range(W)] for s in starts], dtype=torch.long, device=dev)
        slots = torch.tensor([[s + j if j < n else self.spare for j in range(W)] for s, n in zip(starts, lens)],
                             dtype=torch.long, device=dev)
        return (torch.tensor(lens, dtype=torch.long, device=dev), feats,
                torch.tensor(tokens, dtype=torch.long, device=dev).view(len(lens), W), positions, slots)

    def _catch_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row's unfed pairs; returns each row's last output state [B, H] and the draft
        vocabulary log-probabilities after it [B, Vd]."""
        counts, feats, tokens, positions, slots = self._unfed_pairs()
        width = int(self.lengths.max()) + positions.shape[1]
        mask = (torch.arange(width, device=positions.device)[None, None] <= positions[:, :, None])[:, None]
        state, normed = self._step(self.embed(tokens), self.net.features(feats), positions, slots, width, mask)
        last = (counts - 1).clamp_min(0)
        pick = torch.arange(len(counts), device=positions.device)
        self.lengths = self.lengths + counts
        return state[pick, last], self._logprobs(normed[pick, last])

    def _propose_chain(self, gamma: int) -> Proposal:
        """The proposal beside a target on the kernels, in one kernel call (``KernelLayers.chain``): the
        catch-up, then a chain of up to min(γ, DEPTH) levels, each the head's TOP_K most probable
        tokens after the level before's best; the tree is the chain and its siblings, best first
        (sorted in the kernel: ``_best_first``'s order). Every head step reads one row (a tree's
        read BEAM), the cost a verify block of a few rows on a CPU can afford."""
        counts, feats, tokens = self._unfed_block()
        starts = self.lengths.tolist()
        *_, tokens, lengths, parents, scores = self.kernel_layers.chain(
            feats, tokens, starts, counts, self.spare, min(DEPTH, max(gamma, 1)), max(gamma, 1), self.keys,
            self.values, self.embed.weight, self.outside)
        self.lengths = torch.tensor([s + c for s, c in zip(starts, counts)], device=self.lengths.device)
        return Proposal(tokens, lengths, None, parents, scores)

    def _logprobs(self, normed: torch.Tensor) -> torch.Tensor:
        logits = self.net.lm_head(normed).float()
        if self.outside is not None:
            logits = logits.masked_fill(self.outside.to(logits.device), float("-inf"))
        return logits.log_softmax(-1)

    def propose(self, gamma: int) -> Proposal:
        return self.propose_among(gamma, None)

    @torch.no_grad()
    def propose_among(self, gamma: int, rivals: torch.Tensor | None) -> Proposal:
        """``propose``, the tree's nodes competing with ``rivals`` (probabilities [B, R] of nodes
        another drafter offers; None: none) for the budget."""
        t0, first, self.first, self.catchup_seconds = time.perf_counter(), self.first, False, 0.0
        if self.chains:
            prop = self._propose_chain(gamma)
        else:
            if rivals is None:
                rivals = torch.zeros(len(self.unfed), 0, device=self.ctx.device)
            prop = self._propose_tree(gamma, rivals)
        if first:  # γ auto leaves the prompts' catch-up out of what drafting costs
            self.catchup_seconds = seconds_since(t0, self.ctx.device)
        return prop

    def _propose_tree(self, gamma: int, rivals: torch.Tensor) -> Proposal:
        net, dev = self.net, self.ctx.device
        rivals = rivals.to(dev, torch.float32).log()  # log-probabilities, as the tree's scores
        root_state, logp = self._catch_up()
        B, k = root_state.shape[0], min(TOP_K, logp.shape[-1])
        # candidates of all depths, per row: draft-vocabulary token, cumulative log-prob, parent
        # (candidate index, -1 under the root), depth; expanded ones also own an expansion slot
        score, tok = logp.topk(k, -1)
        parent = torch.full((B, k), -1, dtype=torch.long, device=dev)
        depth = torch.ones(B, k, dtype=torch.long, device=dev)
        E = (DEPTH - 1) * BEAM
        seen = torch.zeros(B, k, E, dtype=torch.bool, device=dev)  # expansion slots each candidate attends to
        base = self.lengths  # expansion slot e lives at cache slot base + e
        states = root_state[:, None].expand(B, k, -1)  # the state each depth-1 candidate reads
        first, rows = 0, torch.arange(B, device=dev)[:, None]
        for d in range(1, min(DEPTH, max(gamma, 1))):
            level = slice(first, score.shape[1])
            best = score[:, level].max(-1).values  # no deeper node can score above its level's best
            pool = torch.cat([score, rivals], 1)  # the nodes competing for the `gamma` slots (rivals: -inf pads)
            kth = pool.topk(min(gamma, pool.shape[1]), -1).values[:, -1]
            if float(best.max().exp()) < MIN_SCORE or (pool.shape[1] >= gamma and bool((best <= kth).all())):
                break  # too unlikely, or nothing deeper could enter the best `gamma` nodes: the tree is final
            w = min(BEAM, level.stop - level.start)
            pick = score[:, level].topk(w, -1).indices + first  # [B, w] candidates to expand
            e = torch.arange((d - 1) * BEAM, (d - 1) * BEAM + w, device=dev)
            own = seen[rows, pick] | torch.nn.functional.one_hot(e, E).bool()[None]  # [B, w, E]
            slots = base[:, None] + e[None]
            width = int(base.max()) + E
            cache = torch.arange(width, device=dev)[None, None]
            rel = cache - base[:, None, None]
            mask = (rel < 0) | own.gather(2, rel.clamp(0, E - 1).expand(B, w, width)) & (rel < E)
            parent_states = states.gather(1, (pick - first)[..., None].expand(-1, -1, states.shape[-1]))
            out, normed = self._step(self.embed(net.target_ids(tok[rows, pick])), parent_states,
                                     (base - 1)[:, None] + d, slots, width, mask[:, None])
            child_lp, child_tok = self._logprobs(normed).topk(k, -1)  # [B, w, k]
            first = score.shape[1]
            score = torch.cat([score, (score[rows, pick][..., None] + child_lp).flatten(1)], 1)
            tok = torch.cat([tok, child_tok.flatten(1)], 1)
            parent = torch.cat([parent, pick[..., None].expand(-1, -1, k).flatten(1)], 1)
            depth = torch.cat([depth, torch.full((B, w * k), d + 1, dtype=torch.long, device=dev)], 1)
            seen = torch.cat([seen, own[:, :, None].expand(-1, -1, k, -1).flatten(1, 2)], 1)
            states = out[:, :, None].expand(-1, -1, k, -1).flatten(1, 2)
        return self._best_first(tok, score, parent.tolist(), depth.tolist(), max(gamma, 1))

    def _best_first(self, tok, score, parent: list[list[int]], depth: list[list[int]], budget: int) -> Proposal:
        """The ``budget`` best candidates by score, parents first, as a tree Proposal. ``tok``, ``score``
        [B, C]; per row each candidate's parent (a candidate index, -1 under the root) and depth.
        (Sorted in Python: a few dozen candidates a row, where tensor ops cost ~0.15 ms a proposal.)"""
        B, C = tok.shape
        n = min(budget, C)
        orders, parents = [], []
        for key, par, dep in zip(score.double().tolist(), parent, depth):
            # ties: the shallower first (a parent before its child), then the earlier candidate
            order = sorted(range(C), key=lambda c: dep[c] * 1e-9 - key[c])[:n]
            at = {c: j for j, c in enumerate(order)}
            orders.append(order)
            parents.append([at.get(par[c], -1) if par[c] >= 0 else par[c] for c in order])
        dev = tok.device
        order = torch.tensor(orders, dtype=torch.long, device=dev).view(B, n)
        tokens = self.net.target_ids(tok.gather(1, order))
        lengths = torch.full((B,), n, dtype=torch.long, device=dev)
        return Proposal(tokens, lengths, None, torch.tensor(parents, dtype=torch.long, device=dev).view(B, n),
                        score.gather(1, order).exp())


def _rows(block: torch.Tensor) -> list[torch.Tensor]:
    """A block of feature rows as a list of blocks (none for no rows)."""
    return [block] if block.shape[0] else []


def _split_rows(blocks: list[torch.Tensor], k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The first ``k`` rows of a list of blocks (or all there are), and the rest, as blocks."""
    first, rest = [], []
    for block in blocks:
        n = block.shape[0]
        if k >= n:
            first.append(block)
        elif k > 0:
            first.append(block[:k])
            rest.append(block[k:])
        else:
            rest.append(block)
        k = max(0, k - n)
    return first, rest


def joined_rows(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The rows of a non-empty list of blocks as one tensor."""
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _vllm(folder: str, cfg: dict, fixed: int | None) -> dict:  # vLLM drafts a chain of N tokens with it
    return {"method": "eagle3", "model": str(Path(folder).resolve()), "num_speculative_tokens": fixed or 5}


EAGLE = TrainedKind(
    name="eagle", model_type="eagle3", network=EagleNet, load=load_eagle, training_config=trained.training_config,
    settings_of=trained.settings_of, trainer=trained.trainer, init_from_target=trained.init_from_target, vllm=_vllm,
    trees=True, taps_optional=True, train_help="an EAGLE-3 head drafting token trees",
    options=(TrainOption("layers", 1, "drafter decoder layers"),
             TrainOption("ttt_steps", 3, "training-time-test steps (the head fed its own output states)")))

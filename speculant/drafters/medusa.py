"""``medusa:DIR``: trained Medusa heads propose a token tree from the target's last hidden state.

The verify pass hands over the final normed hidden state of the last token it cached (the one
whose logits gave the pass's next token, the tree's root); one forward of the K heads gives K
distributions, for the tokens 1..K after the root. The tree is grown best-first: a node's score is
the product of its path's head probabilities, children of a depth-d node are head d+1's top
candidates, nodes are listed by decreasing score (so any prefix is a tree and the engine may cut
it to its budget). The drafts are a deterministic function of the accepted text (q one-hot), so
greedy and sampled verification both stay exact.
"""
from __future__ import annotations

import heapq

import torch

from ..trained import medusa as trained
from ..trained.format import load_network
from ..trained.medusa import MedusaNet
from .base import DraftContext, Drafter, Proposal, tree_proposal
from .model import fit_vocab
from .spec import TrainedKind, TrainOption

TOP_PER_HEAD = 4  # candidates per depth the tree may branch into


def load_medusa(folder: str, target: torch.nn.Module, target_name: str, dtype=None) -> "MedusaDrafter":
    net = load_network(folder, target, target_name, MedusaNet, "Medusa heads", dtype)
    return MedusaDrafter(net, target, label=str(folder))


class MedusaDrafter(Drafter):
    name = "medusa"
    makes_trees = True
    block_drafts = True  # one forward of the heads per pass, whatever the tree's size

    def __init__(self, net: MedusaNet, target: torch.nn.Module, label: str = "medusa"):
        self.net, self.label = net, label
        self.head = target.get_output_embeddings()
        self.hidden_layers = net.taps

    def describe(self) -> str:
        return f"medusa:{self.label}"

    def start(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.last = torch.stack([h[-1, 0] for h in ctx.prompt_hidden])  # [B, H]

    def observe_hidden(self, hidden: list[torch.Tensor]) -> None:
        # a row that cached nothing this pass (it just joined) keeps the state its prompt left
        self.last = torch.stack([h[-1, 0] if h.shape[0] else last for h, last in zip(hidden, self.last)])

    def update(self, new_tokens, n_accepted) -> None:
        pass  # the tree hangs under the pass's first token; the heads need only the hidden state

    row_fields = ("last",)  # per-row state (PerRow)
    joins = True

    @torch.no_grad()
    def propose(self, gamma: int) -> Proposal:
        V, net = self.ctx.vocab_size, self.net
        states = net(self.last)  # [B, K, H]
        if net.draft_vocab:  # rank in the draft vocabulary, then map: never builds the V-wide rows
            ids = torch.arange(net.d2t.shape[0], device=net.d2t.device) + net.d2t
            small = net.lm_head(states).float().masked_fill(ids >= V, float("-inf"))
            top_p, top = small.log_softmax(-1).exp().topk(min(TOP_PER_HEAD, small.shape[-1]), dim=-1)
            top_i = ids[top]
        else:
            logits = fit_vocab(net.logits(states, self.head, V), V)  # [B, K, V]
            top_p, top_i = logits.log_softmax(-1).exp().topk(min(TOP_PER_HEAD, V), dim=-1)
        return tree_proposal([best_first(p, i, gamma) for p, i in zip(top_p.tolist(), top_i.tolist())],
                             self.ctx.device)


def best_first(probs: list[list[float]], ids: list[list[int]], budget: int):
    """(tokens, parents, scores) of the ``budget`` most probable paths' nodes: depth d's candidates
    are ids[d - 1] with probs[d - 1]; a path's score is the product along it."""
    tokens, parents, scores = [], [], []
    heap = [(-probs[0][c], 0, c, -1) for c in range(len(ids[0]))]  # (−score, depth index, candidate, parent)
    heapq.heapify(heap)
    while heap and len(tokens) < budget:
        neg, d, c, parent = heapq.heappop(heap)
        tokens.append(ids[d][c])
        parents.append(parent)
        scores.append(-neg)
        node = len(tokens) - 1
        if d + 1 < len(ids):
            for c2 in range(len(ids[d + 1])):
                heapq.heappush(heap, (neg * probs[d + 1][c2], d + 1, c2, node))
    return tokens, parents, scores


MEDUSA = TrainedKind(
    name="medusa", model_type="medusa", network=MedusaNet, load=load_medusa, training_config=trained.training_config,
    settings_of=trained.settings_of, trainer=trained.trainer, init_from_target=trained.init_from_target, trees=True,
    train_help="heads on the last hidden state", vllm=None,
    options=(TrainOption("heads", 4, "heads (tokens guessed beyond the next one)"),
             TrainOption("layers", 1, "residual blocks per head")),
    no_vllm="vLLM's Medusa format gives every head its own LM head and has no draft vocabulary; speculant's medusa "
            "folders share one: export ngram, suffix, dflash:DIR or eagle:DIR instead")

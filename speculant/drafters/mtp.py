"""``mtp``: the target's own multi-token prediction layers (DeepSeek-V3/R1, GLM-4.5, MiMo,
Qwen3-Next keep them in their checkpoints); ``mtp:DIR`` / ``trained:DIR``: a speculators ``mtp``
folder (``speculant train --kind mtp`` writes one for a target without them). They draft a chain.

The verify pass hands over the target's final normed state of every token it cached. Layer 0 reads
(state at position i, token i+1) at position i and predicts token i+2: each proposal first feeds
it every position whose next token is now accepted (its KV cache keeps them), and its output at the
last one drafts the first token. With several MTP layers, step k is layer k at that same position,
reading layer k-1's output there and the token k after (DeepSeek's design: layer k's cache holds
positions whose token k ahead is accepted, the last k positions recomputed each proposal from the
drafts). Further steps reuse the last layer (as vLLM does): at the next position, reading its own
output and the token it drafted. Each draft is picked from the processed distribution q of its
logits (greedy: the argmax), so verification stays exact.

Nothing rolls back: a layer's cache keeps only positions whose inputs are accepted text; draft
positions are written past them and overwritten by the next proposal.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..errors import SpeculantError
from ..models.fast import cat_rows
from ..sampling import TokenHistory
from ..trained import mtp as trained
from ..trained.format import load_network, placed
from ..trained.mtp import MTPNet, _SlotCache, native_net
from .base import DraftContext, Drafter, Proposal, seconds_since
from .model import fit_vocab
from .spec import Build, TrainedKind, TrainOption

MAX_STEPS = 16  # the longest chain one proposal drafts


def load_mtp(folder: str, target: torch.nn.Module, target_name: str, dtype=None) -> "MTPDrafter":
    """A speculators ``mtp`` folder (embeddings and LM head are the target's: speculators saves
    neither, or copies of them that are not read)."""
    net = load_network(folder, target, target_name, MTPNet, "an MTP network", dtype,
                       ignore=("embed_tokens.", "lm_head.", "verifier_lm_head.", "t2d", "d2t"))
    return MTPDrafter(net, target, label=str(folder))


def target_folder(model: torch.nn.Module) -> Path | None:
    """The checkpoint folder a target was loaded from (transformers records it), if any."""
    path = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    return Path(path) if path and Path(path).is_dir() else None


def own_mtp(b: Build) -> "MTPDrafter":
    """``--drafter mtp``: the MTP layers in the target's own checkpoint."""
    model, name = b.target.model, b.target.name
    folder = target_folder(model)
    net = native_net(model, folder) if folder is not None else None
    if net is None:
        raise SpeculantError(f"{name} has no MTP layers in its checkpoint (DeepSeek-V3/R1, GLM-4.5, MiMo and "
                             "Qwen3-Next keep theirs there): train one with `speculant train --kind mtp --target ... "
                             "--out DIR` and use --drafter mtp:DIR")
    # as a folder's network: on the CPU kernels beside a target on them, else in the asked dtype
    net = placed(net, model, b.dtype if isinstance(b.dtype, torch.dtype) else None)
    return MTPDrafter(net, model, label="")


class MTPDrafter(Drafter):
    name = "mtp"
    max_gamma = MAX_STEPS

    def __init__(self, net: MTPNet, target: torch.nn.Module, label: str = ""):
        self.net, self.label = net, label
        self.embed = target.get_input_embeddings()
        self.target_head = target.get_output_embeddings()
        self.hidden_layers = (target.config.get_text_config().num_hidden_layers,)  # its final normed state

    def describe(self) -> str:
        return f"mtp:{self.label}" if self.label else f"mtp ({len(self.net.mtp_layers)} own layer(s), "\
                                                      f"{self.net.layout.name} layout)"

    def state_bytes(self, rows: int, tokens: int) -> int:
        cfg = self.net.hf_config
        width = 2 * (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * \
            (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        return len(self.net.mtp_layers) * rows * (tokens + MAX_STEPS) * width * (torch.finfo(self.net.dtype).bits // 8)

    def start(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        B, n = len(ctx.prompts), len(self.net.mtp_layers)
        self.size = (ctx.max_tokens or max(len(p) for p in ctx.prompts) + 4096) + MAX_STEPS + 1  # last: padding
        self.caches = [_SlotCache(B, self.size) for _ in range(n)]
        self.done = [[0] * B for _ in range(n)]  # per layer and row: positions committed to its cache
        # per layer and row: its input states from position done on (layer 0: the target's)
        self.inputs = [[h[:, 0] for h in ctx.prompt_hidden]] + [[None] * B for _ in range(1, n)]
        self.text = [list(p) for p in ctx.prompts]
        proc = ctx.processing
        self.history = TokenHistory(ctx.prompts, ctx.vocab_size, ctx.device, proc) if proc.uses_context else None
        self.first = True

    def observe_hidden(self, hidden: list[torch.Tensor]) -> None:
        self.inputs[0] = [torch.cat([x, h[:, 0].to(x.device)]) for x, h in zip(self.inputs[0], hidden)]

    def update(self, new_tokens, n_accepted) -> None:
        for text, new in zip(self.text, new_tokens):
            text.extend(new)
        if self.history is not None:
            self.history.extend(new_tokens)

    # per-row state (PerRow); the caches, which may not exist yet, are joined by hand
    row_fields = ("text", "history")
    layer_fields = ("done", "inputs")
    joins = True

    def _select_more(self, rows) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.ctx.device)
        for cache in self.caches:
            cache.take(idx)

    def _join_more(self, other: "MTPDrafter") -> None:
        for mine, theirs in zip(self.caches, other.caches):
            if mine.keys is None and theirs.keys is None:  # neither batch has drafted yet
                mine.rows += theirs.rows
                continue
            for empty, full in ((mine, theirs), (theirs, mine)):  # a batch that never drafted: nothing cached
                if empty.keys is None:
                    empty.keys = full.keys.new_zeros(empty.rows, *full.keys.shape[1:])
                    empty.values = full.values.new_zeros(empty.rows, *full.values.shape[1:])
            mine.keys, mine.values = cat_rows(mine.keys, theirs.keys), cat_rows(mine.values, theirs.values)
            mine.rows, mine.size = mine.keys.shape[0], mine.keys.shape[2]
        self.size = max(self.size, other.size)

    def _forward(self, layer: int, feeds: list[tuple[int, torch.Tensor, list[int]]]):
        """Layer ``layer`` over each row's (first position, input states [m, H], tokens [m]): writes
        their K/V at their positions, returns (states, normed) [B, W, H]."""
        dev, net = self.ctx.device, self.net
        B, W = len(feeds), max(1, max(len(t) for _, _, t in feeds))
        states = torch.zeros(B, W, net.hidden_size, dtype=net.dtype, device=dev)
        tokens = torch.zeros(B, W, dtype=torch.long, device=dev)
        starts = torch.tensor([s for s, _, _ in feeds], device=dev)
        counts = torch.tensor([len(t) for _, _, t in feeds], device=dev)
        for b, (_, x, toks) in enumerate(feeds):
            if toks:
                states[b, : len(toks)] = x.to(dev, net.dtype)
                tokens[b, : len(toks)] = torch.tensor(toks, device=dev)
        steps = torch.arange(W, device=dev)[None]
        positions = starts[:, None] + steps
        cache = self.caches[layer]
        cache.slots = torch.where(steps < counts[:, None], positions, self.size - 1)
        cache.width = int((starts + counts).max().clamp_min(1))
        mask = (torch.arange(cache.width, device=dev)[None, None] <= positions[:, :, None])[:, None]
        return net.step(layer, self.embed(tokens), states, positions, cache, mask)

    def _logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        head = self.net.head(layer) or self.target_head
        return fit_vocab(head(normed.to(head.weight.dtype)).float(), self.ctx.vocab_size)

    def _layers(self, steps: int, draft):
        """Layers 0..steps-1, each at the last position: feeds what each can commit and the rows the
        drafts feed; ``draft(j, logits)`` picks draft j. Returns the last layer's output state there."""
        n, L = len(self.net.mtp_layers), [len(t) for t in self.text]
        below = [None] * len(L)  # per row: the layer below's outputs at the positions drafts feed
        for j in range(steps):
            feeds = []
            for b, text in enumerate(self.text):
                start = self.done[j][b]
                states = self.inputs[j][b] if j == 0 else torch.cat([self.inputs[j][b], below[b]])
                feeds.append((start, states, (text + self.drafted[b])[start + 1 + j : L[b] + j]))
            t0 = time.perf_counter()
            out, normed = self._forward(j, feeds)
            if self.first and j == 0:  # the prompt, fed with the first proposal: a one-off
                self.catchup_seconds, self.first = seconds_since(t0, self.ctx.device), False
            last = torch.tensor([len(f[2]) - 1 for f in feeds], device=self.ctx.device).clamp_min(0)
            rows = torch.arange(len(L), device=self.ctx.device)
            draft(j, self._logits(j, normed[rows, last]))
            for b in range(len(L)):  # commit the positions whose token j ahead is accepted text
                count = max(0, L[b] - 1 - j - self.done[j][b])
                if j + 1 < n:
                    self.inputs[j + 1][b] = out[b, :count] if self.inputs[j + 1][b] is None else \
                        torch.cat([self.inputs[j + 1][b], out[b, :count]])
                below[b] = out[b, count : len(feeds[b][2])]
                self.inputs[j][b] = self.inputs[j][b][count:]
                self.done[j][b] += count
        return out[rows, last]

    @torch.no_grad()
    def propose(self, gamma: int) -> Proposal:
        gamma = max(1, min(gamma, MAX_STEPS))
        self.catchup_seconds = 0.0
        dev, B = self.ctx.device, len(self.text)
        proc = self.ctx.processing
        drafts = torch.zeros(B, gamma, dtype=torch.long, device=dev)
        probs = [] if not proc.greedy else None
        self.drafted = [[] for _ in range(B)]

        def draft(j, logits):
            context = self.history.after(drafts[:, :j]) if self.history is not None else None
            tok, q = proc.pick(logits, context, self.ctx.generator, self.ctx.seeded, j)
            drafts[:, j] = tok
            for b, t in enumerate(tok.tolist()):
                self.drafted[b].append(t)
            if probs is not None:
                probs.append(q)

        n = len(self.net.mtp_layers)
        state = self._layers(min(n, gamma), draft)
        last = n - 1 if gamma >= n else None
        for j in range(n, gamma):  # further steps: the last layer again, one position on each time
            feeds = [(len(text) - 2 + j - n + 1, state[b : b + 1], [self.drafted[b][j - 1]])
                     for b, text in enumerate(self.text)]
            out, normed = self._forward(last, feeds)
            state = out[:, 0]
            draft(j, self._logits(last, normed[:, 0]))
        lengths = torch.full((B,), gamma, dtype=torch.long, device=dev)
        return Proposal(drafts, lengths, torch.stack(probs, 1) if probs else None)


def _vllm(folder: str | None, cfg: dict, fixed: int | None) -> dict:
    """vLLM's MTP method: the target's own layers (no model), or a speculators folder (vLLM maps
    those to its Qwen3-Next and MiMo MTP models)."""
    out = {"method": "mtp", "num_speculative_tokens": fixed or 1}
    if folder is not None:
        out["model"] = str(Path(folder).resolve())
    return out


MTP = TrainedKind(
    name="mtp", model_type="mtp", network=MTPNet, load=load_mtp, training_config=trained.training_config,
    settings_of=trained.settings_of, trainer=trained.trainer, init_from_target=trained.init_from_target, vllm=_vllm,
    taps_optional=True, bare=own_mtp, draft_vocab=False,
    train_help="a multi-token prediction layer drafting a chain (vLLM's and speculators' MTP)",
    options=(TrainOption("ttt_steps", 3, "training-time-test steps (the head fed its own output states)"),))

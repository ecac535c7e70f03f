"""The EAGLE-3 drafter network (Li et al. 2025), as speculators defines it (``speculators_model_type:
"eagle3"``), and its training with training-time test.

One decoder layer drafts autoregressively over the target's own features. The target's hidden
states at a low, a middle and a high layer (concatenated, normed, projected by ``fc``) describe
position t; with the embedding of token t+1 they are the drafter's input there, and its output
predicts token t+2. The drafter keeps its own KV cache over the accepted text; each further draft
step feeds the drafter's own output state back with the token it just drafted (the target's
features exist only for text the target has verified). Training-time test (EAGLE-3) trains exactly
that: step k of a training sequence feeds step k-1's output states, and its queries attend to the
target-feature keys before them and to their own earlier steps' keys.

Parameter names are speculators' (``input_norm`` for norm_before_fc, ``fc``, ``layers.0`` with a
``hidden_norm`` and q/k/v reading [embedding, hidden] (twice the width), ``norm``, ``lm_head`` over
the draft vocabulary, buffers ``d2t``/``t2d``); token embeddings are the target's and not stored.
speculators loads a folder saved here and vLLM serves it (``"method": "eagle3"``).
"""
from __future__ import annotations

import random

import torch
from torch import nn

from .blocks import Layer, RMSNorm, copy_target_head, inv_freq, rope
from .format import SPECULATORS_VERSION, layer_config, speculators_config, target_fingerprint
from .losses import GreedyRuns, answer_rows, as_batch, head_kl, judged_steps


class EagleFirstLayer(Layer):
    """The first layer reads [token embedding, hidden state]: each half normed on its own; the
    residual stream carries the hidden state (normed first with ``norm_before_residual``)."""

    def __init__(self, cfg: dict, norm_before_residual: bool):
        super().__init__(cfg, in_dim=2 * cfg["hidden_size"])
        self.hidden_norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        self.norm_before_residual = norm_before_residual

    def forward(self, x, cos_sin, kv, mask):
        embeds, hidden = x.chunk(2, -1)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attn_in = torch.cat([self.input_layernorm(embeds), normed], -1)
        h = residual + self.self_attn(attn_in, cos_sin, kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleNet(nn.Module):
    """``cfg``: the speculators Eagle3 config dict."""

    def __init__(self, cfg: dict, own_embeddings: bool = False):
        super().__init__()
        tl = cfg["transformer_layer_config"]
        H, eps = tl["hidden_size"], tl.get("rms_norm_eps", 1e-6)
        target_hidden = cfg.get("target_hidden_size") or H
        self.taps = tuple(cfg["eagle_aux_hidden_state_layer_ids"])
        width = len(self.taps) * target_hidden
        self.norm_output = bool(cfg.get("norm_output", False))
        self.input_norm = RMSNorm(width, eps) if cfg.get("norm_before_fc") else None
        self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, eps) for _ in self.taps) if cfg.get("fc_norm") else None
        self.fc = nn.Linear(width, H, bias=False)
        self.layers = nn.ModuleList([EagleFirstLayer(tl, bool(cfg.get("norm_before_residual")))] +
                                    [Layer(tl) for _ in range(1, tl["num_hidden_layers"])])
        self.norm = RMSNorm(H, eps)
        self.register_buffer("inv_freq", inv_freq(tl), persistent=False)
        vocab, draft_vocab = tl["vocab_size"], cfg.get("draft_vocab_size") or tl["vocab_size"]
        # token embeddings: the target's, unless the folder stores its own (speculators saves them)
        self.embed_tokens = nn.Embedding(vocab, H) if own_embeddings else None
        self.draft_vocab = draft_vocab != vocab
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        # draft id i is target id i + d2t[i] (speculators' convention); t2d marks the kept target ids
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long) if self.draft_vocab else None)
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool) if self.draft_vocab else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's tapped hidden states [.., len(taps), Ht] -> the drafter's input states [.., H]."""
        x = aux.to(self.dtype).flatten(-2)
        if self.input_norm is not None:  # speculators' order: the whole concatenation first, then each tap
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for c, norm in zip(x.chunk(len(self.fc_norm), -1), self.fc_norm)], -1)
        return self.fc(x)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kvs, mask: torch.Tensor):
        """One drafting step for embeds, hidden [B, T, H] at positions [B, T]; ``kvs[l](k, v)`` gives
        layer l's keys/values to attend to (mask [B, 1, T, S]). Returns (the state the next step
        reads, the normed state the LM head reads)."""
        h = torch.cat([embeds.to(self.dtype), hidden], -1)
        cos_sin = rope(positions, self.inv_freq, self.dtype)
        for layer, kv in zip(self.layers, kvs):
            h = layer(h, cos_sin, kv, mask)
        normed = self.norm(h)
        return (normed if self.norm_output else h), normed

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> the target's token ids."""
        return draft_ids + self.d2t[draft_ids] if self.draft_vocab else draft_ids


def eagle_config(target: nn.Module, target_name: str, taps: list[int], draft_vocab_size: int, steps: int,
                 layers: int = 1) -> dict:
    """A speculators Eagle3 config for ``target``: Llama decoder layers of its width and rope, the
    EAGLE-3.1 normalisation choices speculators trains with (norm before fc, before the residual,
    and on the state fed back), tapped layer ids, the draft vocabulary."""
    layer_cfg = layer_config(target, layers, "llama")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": draft_vocab_size or layer_cfg["vocab_size"],
        "norm_before_residual": True,
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_output": True,
        "embed_requires_grad": False,
        "target_hidden_size": target.config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(taps),
        "tie_word_embeddings": False,
        "speculators_config": speculators_config("eagle3", steps, target, target_name),
        "speculant_target": target_fingerprint(target),
    }


class EagleTrainer:
    """Training-time test (speculators' Eagle3 recipe): ``loss`` on one sequence's cached features,
    ``loss_batch`` on a batch of right-padded sequences at once (a GPU computes the target's states
    for them on the fly: tools/train_batched.py).

    Row i of a sequence is the pair (target features at position i, token i+1), at position i+1.
    Step 0 reads the target's features; step k reads step k-1's output state and token i+1+k (the
    text's own, i.e. the target's greedy choice in self-distilled data), at position i+1+k; its
    queries see step 0's keys up to row i and their own row's keys of steps 1..k. Each step's
    output at row i is judged against the target's distribution at position i+1+k over the draft
    vocabulary (forward KL), weighted ``decay``^k; answer rows only."""

    def __init__(self, net: EagleNet, embed: nn.Module, target_head: nn.Module, steps: int = 3,
                 decay: float = 1.0, eval_steps: int = 6):
        self.net, self.embed, self.steps, self.decay, self.eval_steps = net, embed, steps, decay, eval_steps
        rows = torch.arange(net.lm_head.weight.shape[0])
        rows = net.target_ids(rows.to(net.lm_head.weight.device))
        self.target_rows = target_head.weight.detach()[rows]  # the target's LM head, draft vocabulary only

    def _run(self, f, steps: int, own_tokens: bool):
        """Per step k: draft logits [n, Vd] of every row of one sequence (row i: prediction of token i+2+k)."""
        dev = self.net.fc.weight.device
        steps_out = self._run_batch(f.ids[None].to(dev), f.hidden[None].to(dev), steps, own_tokens)
        return [(logits if logits is not None else self.net.lm_head(normed).float())[0] for normed, logits in steps_out]

    def _run_batch(self, ids: torch.Tensor, aux: torch.Tensor, steps: int, own_tokens: bool):
        """``ids`` [B, T] (right-padded: causal attention keeps padding out of every real row), the
        tapped target states ``aux`` [B, T, taps, Ht] -> per step k, the drafter's normed states
        [B, n, H] that its LM head reads, n = T - 1, and with ``own_tokens`` the draft logits
        [B, n, Vd] its guesses were read from (else None: training judges the states in head_kl)."""
        net = self.net
        B, n = ids.shape[0], ids.shape[1] - 1
        hidden = net.features(aux[:, :-1])  # [B, n, H]
        positions = torch.arange(1, n + 1, device=ids.device)[None]
        keys = [[] for _ in net.layers]
        values = [[] for _ in net.layers]

        def joined(layer):
            def kv(k, v):
                keys[layer].append(k)
                values[layer].append(v)
                return torch.cat(keys[layer], 2), torch.cat(values[layer], 2)
            return kv

        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        own = torch.eye(n, dtype=torch.bool, device=ids.device)
        tokens, out = ids[:, 1:], []
        for k in range(steps):
            mask = torch.cat([causal] + [own] * k, 1)[None, None]
            hidden, normed = net.step(self.embed(tokens), hidden, positions + k, [joined(i) for i in
                                                                                range(len(net.layers))], mask)
            logits = net.lm_head(normed).float() if own_tokens else None
            out.append((normed, logits))
            if own_tokens:  # evaluation: feed its own guesses, as drafting does
                tokens = net.target_ids(logits.argmax(-1))
            else:  # training: the text's next tokens (row i: token i+2+k), past the end a filler
                tokens = torch.cat([ids[:, 2 + k :], ids.new_zeros(B, k + 1)], 1)
        return out

    def loss(self, f, rng: random.Random):
        return self.loss_batch(*as_batch(f, self.net.fc.weight.device), rng=rng)

    def loss_batch(self, ids, aux, final, loss_from, lengths, labels=None, rng=None):
        """The mean over B right-padded sequences (``lengths`` real tokens each, learnt from
        ``loss_from``) of each one's loss: per step k the mean KL over its answer rows, weighted
        ``decay``^k. ``final`` [B, T, Ht]: the target's final normed states (its distributions, which
        EAGLE learns whole: ``labels``, its choices, are not read). Returns (loss or None if no row
        has a token to learn, answer rows)."""
        judged = judged_steps(ids.shape[1] - 1, loss_from, lengths, self.steps, self.decay)
        if judged is None:
            return None, 0
        states, targets, weights = [], [], []
        for k, ((normed, _), (b, i, w)) in enumerate(zip(self._run_batch(ids, aux, self.steps, own_tokens=False),
                                                         judged)):
            states.append(normed[b, i])
            targets.append(final[b, i + 1 + k])
            weights.append(w)
        loss = head_kl(torch.cat(states), self.net.lm_head.weight, torch.cat(targets), self.target_rows,
                       torch.cat(weights))  # one call for every step: one gradient of the LM head held
        return loss, answer_rows(loss_from, lengths)

    @torch.no_grad()
    def evaluate(self, features, rng: random.Random) -> dict:
        """Greedy chain acceptance on held-out sequences: each answer row drafts ``eval_steps``
        tokens feeding its own guesses; α per step, τ = 1 + mean accepted run."""
        runs = GreedyRuns(self.eval_steps, None)
        for f in features:
            n, first = len(f.ids) - 1, max(f.loss_from - 1, 0)
            last = n - self.eval_steps  # rows whose every step has a target token
            if last <= first:
                continue
            picks = torch.stack([self.net.target_ids(x.argmax(-1)) for x in self._run(f, self.eval_steps, True)], 1)
            at = torch.arange(first, last + 1)[:, None] + 1 + torch.arange(self.eval_steps)[None]
            runs.add_picks(picks[first : last + 1].cpu(), f.labels[at])
        return runs.result("rows")


def settings_of(cfg: dict) -> dict:
    """The options a head's config was made with (to train it further in batches)."""
    return {"ttt_steps": cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
            "layers": cfg["transformer_layer_config"]["num_hidden_layers"]}


def training_config(target, verifier: str, s, taps: list[int], draft_size: int) -> dict:
    """``speculant train --kind eagle``: the config of a head for ``target`` (a LoadedModel)."""
    return eagle_config(target.model, verifier, taps, draft_size, s.ttt_steps, s.layers)


def init_from_target(net: EagleNet, target, d2t) -> None:
    """The LM head starts as the target's rows of the draft vocabulary, the final norm as the
    target's (its effective scale, whatever its convention: Gemma's is 1 + w)."""
    model = target.model
    copy_target_head(net.lm_head, model.get_output_embeddings(), d2t)
    final_norm = getattr(getattr(model, "model", None), "norm", None)
    if final_norm is not None:
        ones = torch.ones(1, net.norm.weight.shape[0], device=final_norm.weight.device, dtype=final_norm.weight.dtype)
        net.norm.weight.copy_(final_norm(ones).squeeze(0).float())


def trainer(net: EagleNet, target, s) -> EagleTrainer:
    return EagleTrainer(net, target.model.get_input_embeddings(), target.model.get_output_embeddings(), s.ttt_steps)

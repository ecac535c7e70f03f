"""Multi-token prediction (MTP) layers as a drafter's network: a model's own (DeepSeek-V3/R1, GLM-4.5,
MiMo and Qwen3-Next keep them in their checkpoints) and speculators' ``mtp`` folders.

One MTP step reads the target's last hidden state at position i (its final normed state, as vLLM
hands it over) and the embedding of token i+1, norms each, projects their concatenation back to the
hidden size, runs one decoder layer of the target's own architecture (its attention, MLP or experts,
with a KV cache of the layer's own) and predicts token i+2 through a final norm and the LM head (the
target's, or the layer's own where the checkpoint stores one). Chained, the next step reads this
step's output in place of the target's state, with the token it drafted.

Layouts (``Layout``, ``read_native``): where a checkpoint keeps the layers and how a step reads them.

- DeepSeek-V3 / GLM-4.5: ``model.layers.{num_hidden_layers + i}.*`` (``enorm``, ``hnorm``, ``eh_proj``,
  a decoder layer, ``shared_head.norm`` / ``.head``); the next step reads the layer's output before
  the final norm, and the embedding at position 0 is zeroed (vLLM's ``deepseek_mtp``);
- Qwen3-Next: ``mtp.*`` (``fc``, ``pre_fc_norm_hidden``, ``pre_fc_norm_embedding``, ``layers.i``,
  ``norm``, shared by the layers); the next step reads the normed output (vLLM's ``qwen3_next_mtp``);
- MiMo: ``model.mtp_layers.i.*`` (``token_layernorm``, ``hidden_layernorm``, ``input_proj``,
  ``final_layernorm``), the projection reading [hidden, embedding] (vLLM's ``mimo_mtp``);
- speculators (``speculators_model_type: "mtp"``, ``mtp_layers.0.*``: MiMo's names, [embedding,
  hidden] as Qwen3-Next's): the names every layout is renamed to here.

Training (``MTPTrainer``, ``speculant train --kind mtp``, for a target without MTP layers): a
Qwen3-style layer of the target's width, as speculators' ``MTPDraftModel`` builds it, trained with
training-time test as EAGLE-3 is (step k reads step k-1's output and attends to the target-feature
keys before it and to its own earlier steps), against the target's own distributions.
"""
from __future__ import annotations

import copy
import importlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..errors import SpeculantError
from ..models.kv import cache_keyword
from .format import SPECULATORS_VERSION, layer_config, speculators_config, target_fingerprint
from .losses import GreedyRuns, answer_rows, as_batch, head_kl, judged_steps


@dataclass(frozen=True)
class Layout:
    name: str
    hidden_first: bool = False  # the projection reads [hidden, embedding] (MiMo), not [embedding, hidden]
    chain_normed: bool = True  # the next step reads the normed output (DeepSeek's: the residual stream)
    zero_first: bool = False  # the token embedding at position 0 is zeroed (vLLM's DeepSeek and MiMo)


DEEPSEEK = Layout("deepseek", chain_normed=False, zero_first=True)
QWEN3_NEXT = Layout("qwen3_next")
MIMO = Layout("mimo", hidden_first=True, zero_first=True)
SPECULATORS = Layout("speculators")
LAYOUTS = {x.name: x for x in (DEEPSEEK, QWEN3_NEXT, MIMO, SPECULATORS)}


class _SlotCache:
    """What an HF attention layer writes its new keys/values into (``update``, as a transformers
    Cache): static buffers per row, allocated at the first write in whatever shape the layer caches
    (MLA: its latents), written at ``slots`` [B, T], read back over the first ``width`` slots."""

    def __init__(self, rows: int, size: int):
        self.rows, self.size = rows, size
        self.keys = self.values = None
        self.slots, self.width = None, 0

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is None:
            self.keys = key_states.new_zeros(self.rows, key_states.shape[1], self.size, key_states.shape[3])
            self.values = value_states.new_zeros(self.rows, value_states.shape[1], self.size, value_states.shape[3])
        rows = torch.arange(self.slots.shape[0], device=self.slots.device)[:, None].expand_as(self.slots)
        self.keys.transpose(1, 2).index_put_((rows, self.slots), key_states.transpose(1, 2).to(self.keys.dtype))
        self.values.transpose(1, 2).index_put_((rows, self.slots), value_states.transpose(1, 2).to(self.values.dtype))
        return self.keys[:, :, : self.width], self.values[:, :, : self.width]

    def take(self, idx: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]
        self.rows = len(idx)


class _Joined:
    """A cache for training-time test: each step's keys/values join the earlier steps' (``kv(k, v)``)."""

    def __init__(self, kv):
        self.kv = kv

    def update(self, key_states, value_states, *args, **kwargs):
        return self.kv(key_states, value_states)


def hf_classes(model_type: str):
    """transformers' decoder layer, RMSNorm and rotary embedding classes of a model type."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base = MODEL_MAPPING_NAMES.get(model_type)
    module_name = model_type_to_module_name(model_type)
    try:
        module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    except ImportError:
        module = None
    if base is None or module is None:
        raise SpeculantError(f"MTP layers of model type {model_type!r}: this transformers has no such model")
    prefix = base.removesuffix("Model").removesuffix("Text")

    def find(suffix):
        names = [n for n in dir(module) if n.endswith(suffix)]
        return getattr(module, prefix + suffix, None) or (getattr(module, names[0]) if len(names) == 1 else None)

    found = find("DecoderLayer"), find("RMSNorm"), find("RotaryEmbedding")
    if None in found:
        raise SpeculantError(f"MTP layers of model type {model_type!r}: transformers' {module_name} module has no "
                             "decoder layer, RMSNorm and rotary embedding to build them from")
    return found


def layer_index(cfg, native: bool) -> int:
    """The index an MTP layer is built at: after the model's layers (native checkpoints: MoE, not a
    first dense layer), else as speculators builds it (0; a hybrid model's last full-attention layer)."""
    if native:
        return cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or [])
    if "linear_attention" not in types:
        return 0
    return max(i for i, t in enumerate(types) if t == "full_attention")


class MTPNet(nn.Module):
    """MTP layers in speculators' names (``mtp_layers.i``: a decoder layer with ``token_layernorm``,
    ``hidden_layernorm``, ``input_proj``, ``final_layernorm`` and, where stored, its own ``head``).
    ``cfg``: a speculators ``mtp`` config; ``native``: (the target, its layout, layers, own heads) to
    build a checkpoint's own layers with the target's classes and rotary embedding instead."""

    def __init__(self, cfg: dict | None = None, native: tuple | None = None):
        super().__init__()
        if native is not None:
            target, self.layout, n, heads = native
            decoder = target.get_decoder()
            hf_cfg = copy.deepcopy(target.config.get_text_config())
            classes = type(decoder.layers[-1]), type(decoder.norm), None
            rotary = decoder.rotary_emb
        else:
            from transformers import AutoConfig

            tl = dict(cfg["transformer_layer_config"])
            self.layout, n, heads = SPECULATORS, int(cfg.get("num_nextn_predict_layers") or 1), False
            hf_cfg = AutoConfig.for_model(**tl)
            classes = hf_classes(tl["model_type"])
            rotary = classes[2](config=hf_cfg)
        first = layer_index(hf_cfg, native is not None)
        if getattr(hf_cfg, "layer_types", None):  # the MTP layers attend fully, after the model's own
            hf_cfg.layer_types = list(hf_cfg.layer_types) + ["full_attention"] * (first + n - len(hf_cfg.layer_types))
        hf_cfg._attn_implementation = "sdpa"
        self.hf_config, self.hidden_size = hf_cfg, hf_cfg.hidden_size
        self._rotary = [rotary]  # not a submodule: shared with the target, float32 whatever our dtype
        self.mtp_layers = nn.ModuleList(self._layer(classes[0], classes[1], first + i, heads) for i in range(n))
        self.cache_keyword = cache_keyword(classes[0].forward)

    def _layer(self, layer_cls, norm_cls, index: int, head: bool) -> nn.Module:
        H, eps = self.hidden_size, self.hf_config.rms_norm_eps
        layer = layer_cls(self.hf_config, index)
        layer.token_layernorm = norm_cls(H, eps=eps)
        layer.hidden_layernorm = norm_cls(H, eps=eps)
        layer.input_proj = nn.Linear(2 * H, H, bias=False)
        layer.final_layernorm = norm_cls(H, eps=eps)
        if head:
            layer.head = nn.Linear(H, self.hf_config.vocab_size, bias=False)
        return layer

    @property
    def dtype(self) -> torch.dtype:
        return self.mtp_layers[0].input_proj.weight.dtype

    def step(self, i: int, embeds, hidden, positions, cache, mask):
        """Layer i over embeds, hidden [B, T, H] at positions [B, T]; ``cache``: what its attention
        writes into and reads (``update``); mask [B, 1, T, S] (True: attend). Returns (the state the
        next step reads, the normed state the LM head reads)."""
        layer, layout = self.mtp_layers[i], self.layout
        embeds = embeds.to(self.dtype)
        if layout.zero_first:
            embeds = embeds.masked_fill((positions == 0)[..., None], 0)
        e, h = layer.token_layernorm(embeds), layer.hidden_layernorm(hidden.to(self.dtype))
        x = layer.input_proj(torch.cat([h, e] if layout.hidden_first else [e, h], -1))
        rotary = self._rotary[0]
        if rotary.inv_freq.device != x.device:
            rotary.to(x.device)
        additive = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~mask, torch.finfo(x.dtype).min)
        out = layer(x, attention_mask=additive, position_ids=positions, position_embeddings=rotary(x, positions),
                    use_cache=True, **{self.cache_keyword: cache})
        out = out[0] if isinstance(out, tuple) else out
        normed = layer.final_layernorm(out)
        return (normed if layout.chain_normed else out), normed

    def head(self, i: int):
        """Layer i's own LM head, or None (the target's)."""
        return getattr(self.mtp_layers[i], "head", None)


# ---------------------------------------------------------------------------------------------------
# a model's own MTP layers, read from its checkpoint


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Each tensor name of a safetensors checkpoint (sharded or not) -> the file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


def _deepseek_name(key: str, first: int) -> str | None:
    m = re.match(r"model\.layers\.(\d+)\.(.*)", key)
    if m is None or int(m.group(1)) < first:
        return None
    rest = m.group(2)
    for old, new in (("enorm.", "token_layernorm."), ("hnorm.", "hidden_layernorm."), ("eh_proj.", "input_proj."),
                     ("shared_head.norm.", "final_layernorm."), ("shared_head.head.", "head.")):
        if rest.startswith(old):
            rest = new + rest[len(old):]
    if rest.startswith("embed_tokens."):  # a copy of the target's embeddings: the target's serve
        return None
    return f"mtp_layers.{int(m.group(1)) - first}.{rest}"


_QWEN3_NEXT_SHARED = {"mtp.fc.": "input_proj.", "mtp.pre_fc_norm_hidden.": "hidden_layernorm.",
                      "mtp.pre_fc_norm_embedding.": "token_layernorm.", "mtp.norm.": "final_layernorm."}


def _renamed(layout: Layout, keys, first: int, n: int) -> dict[str, str]:
    """Canonical name -> checkpoint key of every tensor of the MTP layers (a Qwen3-Next layer's
    shared fc and norms named once per layer)."""
    out = {}
    for key in keys:
        if layout is DEEPSEEK:
            name = _deepseek_name(key, first)
            if name is not None:
                out[name] = key
        elif layout is MIMO and key.startswith("model.mtp_layers."):
            out[key[len("model."):]] = key
        elif layout is QWEN3_NEXT and key.startswith("mtp."):
            shared = next((p for p in _QWEN3_NEXT_SHARED if key.startswith(p)), None)
            if shared is not None:
                for i in range(n):
                    out[f"mtp_layers.{i}.{_QWEN3_NEXT_SHARED[shared]}{key[len(shared):]}"] = key
            elif key.startswith("mtp.layers."):
                out["mtp_layers." + key[len("mtp.layers."):]] = key
    return out


def find_layout(keys, num_hidden_layers: int) -> tuple[Layout, int] | None:
    """Which native layout a checkpoint's tensor names hold, and how many MTP layers; None: none."""
    def count(pattern):
        return len({m.group(1) for k in keys if (m := re.match(pattern, k))})

    deep = {int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.", k))}
    deep = {i for i in deep if i >= num_hidden_layers}
    if deep:
        return DEEPSEEK, len(deep)
    if count(r"model\.mtp_layers\.(\d+)\."):
        return MIMO, count(r"model\.mtp_layers\.(\d+)\.")
    if count(r"mtp\.layers\.(\d+)\."):
        return QWEN3_NEXT, count(r"mtp\.layers\.(\d+)\.")
    return None


def _experts_fused(state: dict, expected: dict) -> dict:
    """Per-expert ``experts.{e}.{gate,up,down}_proj.weight`` tensors (as checkpoints store them)
    stacked into the fused ``experts.gate_up_proj`` / ``experts.down_proj`` the HF layer holds."""
    per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for k, v in state.items():
        m = re.match(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", k)
        if m and f"{m.group(1)}.gate_up_proj" in expected:
            per.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for prefix, experts in per.items():
        order = [experts[e] for e in sorted(experts)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in order])
        out[f"{prefix}.down_proj"] = torch.stack([x["down_proj"] for x in order])
    return out


def read_native(target: nn.Module, folder: Path) -> tuple[Layout, int, dict[str, torch.Tensor]] | None:
    """(layout, MTP layers, their tensors in speculators' names) from a target's own checkpoint, or
    None where it holds no MTP layers."""
    files = checkpoint_files(folder)
    found = find_layout(files, target.config.get_text_config().num_hidden_layers)
    if found is None:
        return None
    layout, n = found
    names = _renamed(layout, files, target.config.get_text_config().num_hidden_layers, n)
    state, handles = {}, {}
    try:
        for name, key in names.items():
            path = files[key]
            if path not in handles:
                handles[path] = safe_open(str(path), "pt")
            state[name] = handles[path].get_tensor(key)
    finally:
        handles.clear()
    return layout, n, state


def native_net(target: nn.Module, folder: Path) -> MTPNet | None:
    """The target's own MTP layers from its checkpoint folder, or None where it has none."""
    found = read_native(target, folder)
    if found is None:
        return None
    layout, n, state = found
    head = target.get_output_embeddings().weight
    own = {k for k in state if k.endswith(".head.weight")}
    for k in own:  # DeepSeek-V3 stores the target's head again in every MTP layer: share it
        if state[k].shape == head.shape and torch.equal(state[k].to(head.device, head.dtype), head):
            del state[k]
    net = MTPNet(native=(target, layout, n, any(k in state for k in own)))
    expected = net.state_dict()
    state = _experts_fused(state, expected)
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SpeculantError(f"the MTP layers in '{folder}' ({layout.name} layout) do not match the target's "
                             f"architecture: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    p = next(target.parameters())
    return net.to(device=p.device, dtype=p.dtype).eval()


# ---------------------------------------------------------------------------------------------------
# speculators' format and training (speculant train --kind mtp)


def mtp_config(target: nn.Module, target_name: str, steps: int) -> dict:
    """A speculators ``mtp`` config for ``target``: one Qwen3-style layer of its width and rope (the
    layer type speculators' MTPDraftModel builds), the target's full vocabulary."""
    layer = layer_config(target, 1, "qwen3")
    layer.pop("layer_types")
    return {
        "architectures": ["MTPDraftModel"],
        "speculators_model_type": "mtp",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "num_nextn_predict_layers": 1,
        "speculators_config": speculators_config("mtp", steps, target, target_name),
        "speculant_target": target_fingerprint(target),
    }


class MTPTrainer:
    """Training-time test over the MTP layer (as EAGLE-3's, tools/train.py drives it): row i of a
    sequence is (the target's final state at i, token i+1) at position i; step k reads step k-1's
    output and token i+1+k at position i+k, attending to step 0's keys of rows <= i and to its own
    row's earlier steps; its output is judged against the target's distribution at i+1+k (forward
    KL through the target's LM head, the MTP layer's too), weighted ``decay``^k."""

    def __init__(self, net: MTPNet, embed: nn.Module, head: nn.Module, steps: int = 3, decay: float = 0.6,
                 eval_steps: int = 6):
        self.net, self.embed, self.head = net, embed, head
        self.steps, self.decay, self.eval_steps = steps, decay, eval_steps

    def _run_batch(self, ids: torch.Tensor, final: torch.Tensor, steps: int, own_tokens: bool):
        """Per step k, the normed states [B, n, H] (n = T - 1) the LM head reads, and with
        ``own_tokens`` the step's greedy guesses [B, n] (fed to the next step, as drafting does)."""
        B, n = ids.shape[0], ids.shape[1] - 1
        hidden = final[:, :-1]
        positions = torch.arange(n, device=ids.device)[None].expand(B, n)
        keys, values = [], []

        def joined(k, v):
            keys.append(k)
            values.append(v)
            return torch.cat(keys, 2), torch.cat(values, 2)

        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        own = torch.eye(n, dtype=torch.bool, device=ids.device)
        tokens, out = ids[:, 1:], []
        for k in range(steps):
            mask = torch.cat([causal] + [own] * k, 1)[None, None].expand(B, 1, n, n * (k + 1))
            hidden, normed = self.net.step(0, self.embed(tokens), hidden, positions + k, _Joined(joined), mask)
            guess = None
            if own_tokens:
                guess = self.head(normed.to(self.head.weight.dtype)).argmax(-1)
                tokens = guess
            else:  # the text's next tokens (row i: token i+2+k), past the end a filler
                tokens = torch.cat([ids[:, 2 + k :], ids.new_zeros(B, k + 1)], 1)
            out.append((normed, guess))
        return out

    def loss(self, f, rng: random.Random):
        return self.loss_batch(*as_batch(f, next(self.net.parameters()).device), rng=rng)

    def loss_batch(self, ids, aux, final, loss_from, lengths, labels=None, rng=None):
        """The mean over B right-padded sequences of each one's loss (see the class); ``final``: the
        target's final normed states [B, T, H], its input and its distributions. Returns (loss or
        None if no row has a token to learn, answer rows)."""
        judged = judged_steps(ids.shape[1] - 1, loss_from, lengths, self.steps, self.decay)
        if judged is None:
            return None, 0
        states, targets, weights = [], [], []
        for k, ((normed, _), (b, i, w)) in enumerate(zip(self._run_batch(ids, final, self.steps, own_tokens=False),
                                                         judged)):
            states.append(normed[b, i])
            targets.append(final[b, i + 1 + k])
            weights.append(w)
        w = self.head.weight
        loss = head_kl(torch.cat(states), w, torch.cat(targets), w, torch.cat(weights))
        return loss, answer_rows(loss_from, lengths)

    @torch.no_grad()
    def evaluate(self, features, rng: random.Random) -> dict:
        """Greedy chain acceptance on held-out sequences: each answer row drafts ``eval_steps`` tokens
        feeding its own guesses; α per step, τ = 1 + mean accepted run."""
        runs = GreedyRuns(self.eval_steps, None)
        dev = next(self.net.parameters()).device
        for f in features:
            n, first = len(f.ids) - 1, max(f.loss_from - 1, 0)
            last = n - self.eval_steps
            if last <= first:
                continue
            steps = self._run_batch(f.ids[None].to(dev), f.final[None].to(dev), self.eval_steps, True)
            picks = torch.stack([guess[0] for _, guess in steps], 1)
            at = torch.arange(first, last + 1)[:, None] + 1 + torch.arange(self.eval_steps)[None]
            runs.add_picks(picks[first : last + 1].cpu(), f.labels[at])
        return runs.result("rows")


def settings_of(cfg: dict) -> dict:
    """The options a folder's config was made with (to train it further in batches)."""
    return {"ttt_steps": cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]}


def training_config(target, verifier: str, s, taps: list[int], draft_size: int) -> dict:
    """``speculant train --kind mtp``: an MTP layer for ``target`` (a LoadedModel); it reads the
    target's final normed state, not ``taps``, over the full vocabulary (speculators' MTP has no
    draft vocabulary)."""
    return mtp_config(target.model, verifier, s.ttt_steps)


def init_from_target(net: MTPNet, target, d2t) -> None:
    """The layer starts as the target's last decoder layer (its projections and norms, where the
    names and shapes agree) over the sum of the normed token embedding and hidden state
    (input_proj = [I | I]; the hidden state alone would start as the target's own guess of token
    i+1, one token short), its final norm as the target's."""
    model = target.model
    layer, last = net.mtp_layers[0], model.get_decoder().layers[-1].state_dict()
    own = layer.state_dict()
    layer.load_state_dict({k: v for k, v in last.items() if k in own and own[k].shape == v.shape}, strict=False)
    H = net.hidden_size
    layer.input_proj.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], 1))
    final_norm = getattr(model.get_decoder(), "norm", None)
    if final_norm is not None:
        ones = torch.ones(1, H, device=final_norm.weight.device, dtype=final_norm.weight.dtype)
        layer.final_layernorm.weight.copy_(final_norm(ones).squeeze(0).float())


def trainer(net: MTPNet, target, s) -> MTPTrainer:
    return MTPTrainer(net, target.model.get_input_embeddings(), target.model.get_output_embeddings(), s.ttt_steps)

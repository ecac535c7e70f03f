"""``layerskip``: self-speculation. The target itself, with some decoder layers skipped, drafts;
the full target verifies (Zhang et al. 2023 "Draft & Verify"; Elhoushi et al. 2024 "LayerSkip").

No extra weights: the drafter runs the target's own modules (embeddings, the kept decoder layers,
final norm, LM head). When the target runs on the fast path it also shares the target's KV cache:
each draft step runs the kept layers *in the target's static cache*, reading the full model's K/V
of the accepted text (as Draft & Verify does: no drafter prefill, no second cache, nothing to catch
up on after a pass where it did not draft) and writing its own K/V for the draft positions past
the target's pointer; the pointer is then put back, and the verify pass overwrites exactly those
slots in every layer before any query reads them, so the target's cache stays what a fresh prefill
gives. On the general path it is a ``ModelDrafter`` over a partial forward of the target, with
its own small KV cache for the kept layers.

Specs: ``layerskip`` (the skip set saved by ``speculant tune-layerskip`` for this target if
there is one, else a built-in default), ``layerskip:FILE.json``, ``layerskip:A-B:S`` (skip
layers A..B inclusive, every S-th, e.g. ``layerskip:6-23:2``), ``layerskip:3,5,7`` (a list).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import files
from ..errors import SpeculantError
from ..models.fast import StaticKVState
from ..models.kv import cache_keyword
from ..models.loading import cache_dir
from ..sampling import TokenHistory
from .base import DraftContext, Proposal
from .model import ModelDrafter
from .spec import Build, DrafterKind, DrafterSpec

# Decoder layers of these families take (hidden, attention_mask, position_embeddings, ...) with
# one rotary embedding and plain causal attention, as LlamaModel.forward calls them.
SUPPORTED = ("llama", "qwen2", "qwen3")


def decoder_of(causal_lm: torch.nn.Module):
    base = getattr(causal_lm, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    model_type = getattr(causal_lm.config, "model_type", "?")
    if model_type not in SUPPORTED or base is None or not all(hasattr(base, n) for n in needed):
        raise SpeculantError(
            f"layerskip supports {'/'.join(SUPPORTED)} targets, not '{model_type}': use ngram or model:PATH"
        )
    if getattr(causal_lm.config, "use_sliding_window", False):
        raise SpeculantError("layerskip does not support sliding-window attention: use ngram or model:PATH")
    return base


def num_layers(causal_lm: torch.nn.Module) -> int:
    return len(decoder_of(causal_lm).layers)


def default_skip_layers(n: int) -> list[int]:
    """Skip every other layer of the middle half: early and late layers matter most."""
    return list(range(n // 4 + 1, n - n // 4 - 1, 2))


def check_skip_layers(skip, n: int) -> list[int]:
    skip = sorted(set(int(i) for i in skip))
    if any(i < 0 or i >= n for i in skip):
        raise SpeculantError(f"layerskip: layers to skip must be in 0..{n - 1}, got {skip}")
    if 0 in skip or n - 1 in skip:
        raise SpeculantError(f"layerskip: the first and last layers (0 and {n - 1}) always run; do not skip them")
    return skip


class SkipLayersModel(torch.nn.Module):
    """The target's forward with some decoder layers left out; same call signature as a HF causal LM
    (what KVState calls), returns an object with ``.logits``."""

    def __init__(self, causal_lm: torch.nn.Module, skip_layers: list[int]):
        super().__init__()
        base = decoder_of(causal_lm)
        self.causal_lm = causal_lm
        self.skip_layers = check_skip_layers(skip_layers, len(base.layers))
        self.keep = [i for i in range(len(base.layers)) if i not in set(self.skip_layers)]
        self.config = causal_lm.config

    def get_output_embeddings(self):
        return self.causal_lm.get_output_embeddings()

    @staticmethod
    def additive_mask(attention_mask: torch.Tensor, q_len: int, dtype) -> torch.Tensor:
        """[B, kv] valid columns -> [B, 1, q, kv] additive mask: query i (the last q columns) sees valid
        columns up to its own. Built here rather than with masking_utils, whose signature changes
        between transformers versions."""
        B, kv = attention_mask.shape
        cols = torch.arange(kv, device=attention_mask.device)
        rows = torch.arange(kv - q_len, kv, device=attention_mask.device)
        allowed = (cols[None, :] <= rows[:, None])[None] & attention_mask.bool()[:, None, :]
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )[:, None]

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache=True, logits_to_keep=0, **_):
        base = self.causal_lm.model
        hidden = base.embed_tokens(input_ids)
        mask = self.additive_mask(attention_mask, input_ids.shape[1], hidden.dtype)
        position_embeddings = base.rotary_emb(hidden, position_ids=position_ids)
        for i in self.keep:  # each layer's attention caches under its own layer_idx: skipped ones stay empty
            out = base.layers[i](
                hidden,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=use_cache,
                **{cache_keyword(type(base.layers[i]).forward): past_key_values},
            )
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = base.norm(hidden)
        if isinstance(logits_to_keep, torch.Tensor):  # positions, as KVState.append passes them (HF's meaning)
            hidden = hidden[:, logits_to_keep]
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.causal_lm.get_output_embeddings()(hidden))


def tuned_path(target_name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", target_name)
    return cache_dir() / "layerskip" / f"{safe}.json"


def load_skip_file(path, n: int) -> list[int]:
    text = files.read_text(path, "layerskip skip-set file", limit=1 << 20,
                           hint="give a JSON file written by `speculant tune-layerskip`")
    try:
        data = json.loads(text)
        skip = data["skip_layers"]
    except (ValueError, KeyError, TypeError) as e:
        raise SpeculantError(f"layerskip: cannot read a skip set from '{path}' ({type(e).__name__}): "
                             "give a JSON file written by `speculant tune-layerskip`") from None
    return check_skip_layers(skip, n)


def validate_layerskip_spec(spec: str) -> None:
    arg = spec[len("layerskip") :].lstrip(":")
    if not arg:
        return
    if arg.endswith(".json"):
        files.check_regular(Path(arg).expanduser(), "layerskip skip-set file", "run `speculant tune-layerskip`")
        return
    if not re.fullmatch(r"\d+-\d+(:\d+)?|\d+(,\d+)*", arg):
        raise SpeculantError(
            f"bad layerskip spec {spec!r}: use layerskip, layerskip:FILE.json, layerskip:A-B:STEP or layerskip:I,J,K"
        )
    lo, sep, rest = arg.partition("-")
    if sep:
        hi, _, step = rest.partition(":")
        if int(lo) > int(hi) or int(step or 1) < 1:
            raise SpeculantError(f"layerskip:{arg} skips no layer: A-B:STEP needs A <= B and STEP >= 1 "
                                 "(e.g. layerskip:10-20:2)")


def parse_skip_spec(spec: str, n: int, target_name: str = "") -> tuple[list[int], str]:
    """A ``layerskip[...]`` spec -> (layers to skip, where they came from)."""
    validate_layerskip_spec(spec)
    arg = spec[len("layerskip") :].lstrip(":")
    if not arg:
        saved = tuned_path(target_name) if target_name else None
        if saved is not None and saved.is_file():
            return load_skip_file(saved, n), f"tuned:{saved.name}"
        return check_skip_layers(default_skip_layers(n), n), "default"
    if arg.endswith(".json"):
        return load_skip_file(Path(arg).expanduser(), n), Path(arg).name
    if "-" in arg:
        lo, rest = arg.split("-")
        hi, _, step = rest.partition(":")
        return check_skip_layers(range(int(lo), int(hi) + 1, int(step or 1)), n), arg
    return check_skip_layers(arg.split(","), n), arg


class LayerSkipDrafter(ModelDrafter):
    """The target's own partial forward as a drafter (its q is processed like every drafter's): in
    the target's static cache when the engine gives it one (``shared``), else a ModelDrafter with
    its own cache."""

    name = "layerskip"
    follows_target_path = False  # its own partial forward is general-path only; on the fast path it shares the target's cache

    def __init__(self, target_model: torch.nn.Module, skip_layers: list[int], label: str = ""):
        super().__init__(SkipLayersModel(target_model, skip_layers), label=label)
        self.skip_layers = self.model.skip_layers

    def describe(self) -> str:
        n = len(self.model.keep) + len(self.skip_layers)
        return f"layerskip:{self.label or 'custom'}({len(self.model.keep)}/{n} layers)"

    def start(self, ctx: DraftContext) -> None:
        state = ctx.target_state
        self.shared = isinstance(state, StaticKVState) and state.fast.hf_model is self.model.causal_lm
        if not self.shared:
            return super().start(ctx)
        self.ctx, self.target_state, self.last = ctx, state, None
        proc = ctx.processing
        self.history = TokenHistory(ctx.prompts, ctx.vocab_size, ctx.device, proc) if proc.uses_context else None

    @torch.no_grad()
    def propose(self, gamma: int) -> Proposal:
        if not self.shared:
            return super().propose(gamma)
        state = self.target_state
        start = state.lengths()
        pending = torch.tensor(self.last, dtype=torch.long, device=self.ctx.device)[:, None]  # not cached yet

        def step(tok):
            return state.append(tok, last_only=True, layers=self.model.keep)[:, -1]

        try:
            return self._draft(step(pending), gamma, step)
        finally:
            state.rollback(start)  # the verify pass rewrites these slots in every layer

    def update(self, new_tokens, n_accepted) -> None:
        if not self.shared:
            return super().update(new_tokens, n_accepted)
        self.last = [toks[-1] for toks in new_tokens]
        if self.history is not None:
            self.history.extend(new_tokens)

    @property
    def joins(self) -> bool:
        return not getattr(self, "shared", False)

    def join_refusal(self, fast_target: bool) -> str | None:
        return ("on the fast path it drafts in the target's own cache, which a join replaces with a new one"
                if fast_target else None)

    @property
    def row_fields(self) -> tuple[str, ...]:
        """Per-row state (PerRow): in the target's cache, the batch moves that cache itself."""
        return ("last", "history") if getattr(self, "shared", False) else ModelDrafter.row_fields


def _make(spec: DrafterSpec, b: Build) -> LayerSkipDrafter:
    skip, source = parse_skip_spec(spec.text, num_layers(b.target.model), b.target.name)
    return LayerSkipDrafter(b.target.model, skip, label=source)


LAYERSKIP = DrafterKind("layerskip", "layerskip[:FILE.json|:A-B:STEP]", _make, exact=("layerskip",),
                        prefix="layerskip:", check=lambda spec: validate_layerskip_spec(spec.text))

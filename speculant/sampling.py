"""Logits processing shared by the target (p) and every drafter (q).

Speculative sampling is exact only when p and q are the *processed* distributions, built by the
same function. Everything here is a pure tensor function of logits and the context tokens; it
never knows whether it is processing the target's or a drafter's logits.

Order: repetition penalty (Hugging Face / CTRL), presence and frequency penalties (OpenAI), logit
bias, user logits processors (e.g. a grammar mask), then temperature, top-k, top-p, min-p.

Everything that depends on the text so far comes in a ``Context`` built by ``TokenHistory``: for a
block of draft tokens under verification, position t sees the accepted text plus drafts[:t] --
exactly what plain decoding would have seen there -- for p and for q alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import SpeculantError
from .rows import PerRow


LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]  # (context token ids, logits [V]) -> logits [V]


# The compiled kernels' argmax, handed over by models/native.py once this process has loaded them
# (a lower layer's hook: sampling never builds or imports the kernels itself)
_compiled_argmax = None


def use_compiled_argmax(fn) -> None:
    """``fn(x)``: float32 rows [..., V] on a CPU -> int64 [...], as ``max(-1).indices``."""
    global _compiled_argmax
    _compiled_argmax = _compiled_argmax or fn


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value along the last dimension; ties go to the first, as ``Tensor.argmax``
    (torch documents both). Greedy decoding takes one per verified token: float32 on a CPU the
    compiled kernel's where this process has it (a row of 49k logits: ~8 against ~44 us, 2 cores),
    else ``max``'s indices, as a CPU computes them 3-4x faster than ``argmax`` (26 against 69 us in
    float32, 37 against 164 us in bf16)."""
    if _compiled_argmax is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] > 0:
        return _compiled_argmax(x.contiguous())
    return x.max(-1).indices


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF: over prompt + output
    presence_penalty: float = 0.0  # OpenAI: over the output only
    frequency_penalty: float = 0.0  # OpenAI: over the output only
    logit_bias: dict | None = None  # token id -> added to its logit
    logits_processors: tuple = ()  # callables (context token ids, logits [V]) -> logits [V], applied to p and q alike

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):  # a number, not "0.9"
            if not _finite_number(getattr(self, name)):
                raise SpeculantError(f"{name.replace('_', '-')} must be a number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise SpeculantError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpeculantError(f"top-k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise SpeculantError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise SpeculantError(f"min-p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0):
            raise SpeculantError(f"repetition penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite_number(getattr(self, name)):
                raise SpeculantError(f"{name.replace('_', ' ')} must be a finite number (0 = off), got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SpeculantError(f"logit bias must be a dict of token id -> number, got {type(self.logit_bias).__name__}")
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 or not _finite_number(bias):
                    raise SpeculantError(f"logit bias entries must be token id (int >= 0) -> finite number, got {tok!r}: {bias!r}")
        if not isinstance(self.logits_processors, (tuple, list)) or not all(callable(f) for f in self.logits_processors):
            raise SpeculantError("logits_processors must be a list of callables (token_ids, logits) -> logits")
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def counts_output(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def forms(self) -> tuple[bool, bool, bool]:
        """The forms of the text so far that processing reads: (seen tokens: repetition penalty,
        output counts: presence/frequency, token lists: logits processors)."""
        return self.repetition_penalty != 1.0, self.counts_output, bool(self.logits_processors)

    @property
    def uses_context(self) -> bool:
        """Whether processing depends on the tokens seen so far (then drafts must be included)."""
        return any(self.forms)


def block_counts(counts: torch.Tensor, block_tokens: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
    """How often each position of a block has seen each token.

    counts: [B, V] counts in the accepted context. block_tokens: [B, T-1], tokens fed after that
    context (draft tokens). Returns [B, T, V] where position t has also seen block_tokens[:, :t]
    -- the drafts before it, exactly as plain decoding would have -- or, for a token tree, the
    drafts ``seen`` [B, T, T-1] says it has (its ancestors).
    """
    B, V = counts.shape
    T = block_tokens.shape[1] + 1
    out = counts[:, None, :].expand(B, T, V).clone()
    if T > 1:
        idx = block_tokens[:, None, :].expand(B, T, T - 1)
        if seen is None:  # a chain: position t sees draft j when j < t
            seen = (torch.arange(T - 1, device=counts.device)[None, :] < torch.arange(T, device=counts.device)[:, None])
            seen = seen[None].expand(B, T, T - 1)
        out.scatter_add_(2, idx, seen.to(out.dtype))
    return out


def block_presence(seen: torch.Tensor, block_tokens: torch.Tensor) -> torch.Tensor:
    """``block_counts`` for presence only: [B, V] bool -> [B, T, V] bool."""
    return block_counts(seen.to(torch.int32), block_tokens) > 0


@dataclass
class Context:
    """What processing sees besides the logits, for each scored position (leading shape of the logits)."""

    seen: torch.Tensor | None = None  # bool [..., V]: in prompt or output (repetition penalty)
    counts: torch.Tensor | None = None  # int [..., V]: times in the output (presence / frequency)
    token_ids: list | None = None  # one full token list per position, flattened (logits processors)


class TokenHistory(PerRow):
    """The text of each row so far, kept in the forms the processing needs (only those it needs)."""

    row_fields = ("seen", "counts", "texts")  # None where the processing does not need that form

    def __init__(self, prompts: list[list[int]], vocab: int, device, params: "SamplingParams | LogitsProcessing"):
        self.vocab, self.device = vocab, device
        seen, counts, texts = params.forms
        self.texts = [list(p) for p in prompts] if texts else None
        self.seen = self.counts = None
        if seen:
            self.seen = torch.zeros(len(prompts), vocab, dtype=torch.int32)
            for i, p in enumerate(prompts):
                if p:
                    self.seen[i, torch.tensor(p, dtype=torch.long)] = 1
            self.seen = self.seen.to(device)
        if counts:
            self.counts = torch.zeros(len(prompts), vocab, dtype=torch.int32, device=device)

    def extend(self, new: list[list[int]]) -> None:
        """Row b's text grew by new[b] (accepted drafts and the target's token)."""
        for row, toks in enumerate(new):
            if not toks:
                continue
            idx = torch.tensor(toks, dtype=torch.long, device=self.device)
            if self.seen is not None:
                self.seen[row, idx] = 1
            if self.counts is not None:
                self.counts[row].scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
            if self.texts is not None:
                self.texts[row].extend(toks)

    def block(self, drafts: torch.Tensor, seen: torch.Tensor | None = None) -> Context:
        """Context of each position of a verify block [B, T = G+1]: position t has seen drafts[:, :t],
        or for a token tree the drafts ``seen`` [B, T, G] marks (the node's ancestors)."""
        texts = None
        if self.texts is not None:
            d = drafts.tolist()
            T = drafts.shape[1] + 1
            if seen is None:
                texts = [text + d[b][:t] for b, text in enumerate(self.texts) for t in range(T)]
            else:
                marks = seen.tolist()
                texts = [text + [x for x, m in zip(d[b], marks[b][t]) if m]
                         for b, text in enumerate(self.texts) for t in range(T)]
        return Context(
            block_counts(self.seen, drafts, seen) > 0 if self.seen is not None else None,
            block_counts(self.counts, drafts, seen) if self.counts is not None else None,
            texts,
        )

    def after(self, drafts: torch.Tensor, lengths: torch.Tensor | None = None) -> Context:
        """Context after drafts [B, j] (the position a drafter samples draft j at); with ``lengths``,
        after row b's first lengths[b] drafts only (rows at different positions)."""
        if lengths is None:
            ones = torch.ones_like(drafts, dtype=torch.int32)
        else:
            ones = (torch.arange(drafts.shape[1], device=drafts.device)[None, :] < lengths[:, None]).to(torch.int32)
        seen = self.seen.scatter_add(1, drafts, ones) > 0 if self.seen is not None else None
        counts = self.counts.scatter_add(1, drafts, ones) if self.counts is not None else None
        texts = None
        if self.texts is not None:
            n = ones.sum(1).tolist()
            texts = [text + d[: n[b]] for b, (text, d) in enumerate(zip(self.texts, drafts.tolist()))]
        return Context(seen, counts, texts)


# Settings valid by their ranges but past what float32 logits can carry are read at these bounds:
# the distribution they give is the one the exact setting gives, but where logits differ by less
# than ~1e-30 (a tie in float32 either way). A temperature below float32's smallest normal number
# is read as it (sampling there is greedy in the limit: all mass on the largest logits); penalty
# factors, penalties and biases within 1e30 of their extremes (a logit times 1e30 stays finite).
MIN_TEMPERATURE = 2.0**-126
LOGIT_BOUND = 1e30


def _bounded(x: float, lo: float = -LOGIT_BOUND, hi: float = LOGIT_BOUND) -> float:
    return min(max(float(x), lo), hi)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, ctx: Context | None) -> torch.Tensor:
    """Repetition penalty (HF / CTRL: divide positive logits, multiply negative ones, for tokens in
    prompt or output), then OpenAI's presence and frequency penalties (output tokens only):
    logit - presence * [count > 0] - frequency * count. Factors and penalties are read within
    LOGIT_BOUND (a penalty of 1e-300 would make logits infinite, and infinities NaN)."""
    if ctx is None:
        return logits
    if params.repetition_penalty != 1.0 and ctx.seen is not None:
        rp = _bounded(params.repetition_penalty, 1 / LOGIT_BOUND)
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(ctx.seen, penalised, logits)
    if params.counts_output and ctx.counts is not None:
        counts = ctx.counts.to(logits.dtype)
        logits = (logits - _bounded(params.presence_penalty) * (counts > 0).to(logits.dtype)
                  - _bounded(params.frequency_penalty) * counts)
    return logits


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32, never inf or NaN where the logits are finite: where the
    plain quotient overflows (a tiny temperature, logits penalised to 1e30) each row's largest
    logit is taken off first (softmax is the same for logits shifted by a constant), so the row's
    top logits give 0 and the others large negative numbers or -inf (probability 0)."""
    t = max(float(temperature), MIN_TEMPERATURE)
    logits = logits.float()
    out = logits / t
    trouble = ~torch.isfinite(out.amax(-1)) | out.isnan().any(-1)  # per row: a row's result is its own
    if not bool(trouble.any()):
        return out
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    peak = logits.amax(-1, keepdim=True)
    shifted = torch.where(logits == peak, torch.zeros_like(logits), logits - peak)
    stable = torch.where(torch.isfinite(peak), shifted / t, logits)
    return torch.where(trouble[..., None], stable, out)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on the last dimension; returns probabilities."""
    logits = _scaled(logits, params.temperature)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1 - params.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        threshold = params.min_p * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class ProcessorError(SpeculantError):
    """A logits processor's result that cannot be sampled from; ``processors``: the setting's processors
    (a server can end the rows that use them alone, not their batch)."""

    def __init__(self, message: str, processors: tuple):
        super().__init__(message)
        self.processors = processors


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _result(fn, out, row: torch.Tensor) -> torch.Tensor:
    """A logits processor's result, checked by its type and shape alone (no pass over its values:
    this runs for every scored position)."""
    if isinstance(out, torch.Tensor) and out.shape == row.shape and out.is_floating_point():
        return out
    if isinstance(out, torch.Tensor):
        got = f"a {str(out.dtype).removeprefix('torch.')} tensor of shape {list(out.shape)}"
    else:
        got = "None" if out is None else f"a {type(out).__name__}"
    raise ProcessorError(f"the logits processor {_name(fn)} returned {got}: it must return the logits, a float "
                         f"tensor of shape {list(row.shape)}", (fn,))


def _check_processed(flat: torch.Tensor, given: torch.Tensor, ids: list, fns) -> None:
    """Every processed position that can give a token allows one, and none is NaN: one reduction
    over the positions a call (the rest runs only where one fails). A position where every logit
    is -inf is refused where its text can be reached: every token on its way from the row's first
    position in this call allowed there (after a draft the processors refuse, as a token tree's or
    prompt lookup's may be, nothing is ever read: it is never accepted)."""
    top = flat.amax(-1)  # NaN where a logit is NaN, -inf where every one is
    if bool((top > float("-inf")).all()):
        return
    who = f"the logits processor {_name(fns[0])}" if len(fns) == 1 else \
        f"one of the logits processors ({', '.join(_name(f) for f in fns)})"
    nan = top.isnan().nonzero().flatten().tolist()
    if nan:
        i = nan[0]
        if bool(given.reshape(flat.shape)[i].isnan().any()):
            raise SpeculantError(f"the model's logits hold NaN (after {len(ids[i])} tokens): the model's weights "
                                 "or dtype overflow; try dtype float32")
        raise ProcessorError(f"{who} returned NaN logits (after {len(ids[i])} tokens): return -inf for a "
                             "token not allowed, never NaN", tuple(fns))
    block = given.shape[1] if given.dim() > 2 else 1  # positions a row: [B, T, V] or [B, V]
    for i in (top == float("-inf")).nonzero().flatten().tolist():
        if _reachable(i, flat, ids, block):
            raise ProcessorError(f"the logits processors left no token allowed after {len(ids[i])} tokens (every "
                                 f"logit -inf): {who} must allow at least one token after every text it allows",
                                 tuple(fns))


def _reachable(i: int, flat: torch.Tensor, ids: list, block: int) -> bool:
    """Whether position i's text is reached from its row's first position in this call by tokens
    the processed logits allow (a parent position's text is i's less its last token)."""
    start = i - i % block
    while True:
        mine = ids[i]
        parent = next((j for j in range(start, start + block)
                       if len(ids[j]) == len(mine) - 1 and ids[j] == mine[:-1]), None)
        if parent is None:
            return True
        if not bool(flat[parent, mine[-1]] > float("-inf")):
            return False
        i = parent


class _OneSetting:
    """Processing by one SamplingParams, for any batch."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._bias: torch.Tensor | None = None

    def _add_bias(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.params.logit_bias:
            return logits
        if self._bias is None or self._bias.device != logits.device or self._bias.shape[0] != logits.shape[-1]:
            bias = torch.zeros(logits.shape[-1], dtype=torch.float32)
            for tok, b in self.params.logit_bias.items():
                bias[tok] = _bounded(b)
            self._bias = bias.to(logits.device)
        return logits + self._bias.to(logits.dtype)

    def _run_processors(self, logits: torch.Tensor, ctx: Context | None) -> torch.Tensor:
        if not self.params.logits_processors:
            return logits
        if ctx is None or ctx.token_ids is None:
            raise ValueError("logits processors need the context token ids")
        flat = logits.reshape(-1, logits.shape[-1]).clone()
        for i, ids in enumerate(ctx.token_ids):
            for fn in self.params.logits_processors:
                flat[i] = _result(fn, fn(ids, flat[i]), flat[i])
        _check_processed(flat, logits, ctx.token_ids, self.params.logits_processors)
        return flat.reshape(logits.shape)

    def scores(self, logits: torch.Tensor, ctx: Context | None) -> torch.Tensor:
        logits = apply_penalties(logits, self.params, ctx)
        return self._run_processors(self._add_bias(logits), ctx)

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        if self.params.greedy:  # in a batch with sampled rows: all mass on the argmax
            return torch.nn.functional.one_hot(argmax(scores), scores.shape[-1]).float()
        return warp(scores, self.params)


def _rows_of(ctx: Context | None, idx: list[int], batch: int) -> Context | None:
    """The part of a batch's context that belongs to rows ``idx``."""
    if ctx is None:
        return None
    ids = None
    if ctx.token_ids is not None:
        per_row = len(ctx.token_ids) // batch
        ids = [ctx.token_ids[r * per_row + t] for r in idx for t in range(per_row)]
    return Context(None if ctx.seen is None else ctx.seen[idx], None if ctx.counts is None else ctx.counts[idx], ids)


class LogitsProcessing(PerRow):
    """One processing for p and q. ``scores`` is what greedy takes the argmax of; ``probs`` what
    sampling draws from. ``params``: one SamplingParams for every row (any batch), or one per row
    of a batch, so requests with other settings (greedy or sampled, other temperatures, top-k/p,
    penalties, biases, processors) share it. Rows with equal settings are processed together
    exactly as a batch of only them would be; ``select`` / ``join`` follow the batch's rows."""

    def __init__(self, params: SamplingParams | list[SamplingParams], vocab_size: int | None = None):
        self.rows = None if isinstance(params, SamplingParams) else list(params)  # None: any batch size
        for p in self.rows or [params]:
            bad = [t for t in (p.logit_bias or {}) if vocab_size is not None and t >= vocab_size]
            if bad:
                raise SpeculantError(f"logit bias token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
            if vocab_size is not None and p.top_k > vocab_size:
                raise SpeculantError(f"top-k must be in 0..{vocab_size} (0 = off), got {p.top_k}")
        self._settings: list[_OneSetting] = [_OneSetting(params)] if self.rows is None else []
        self._group()
        # the forms of text the batch keeps (its histories are built from them at its start): a
        # batch keeps them when the rows that needed them leave, and joins only batches that keep
        # the same
        self._forms = tuple(any(f) for f in zip(*(s.params.forms for s, _ in self.groups)))

    def _group(self) -> None:
        """Rows by equal settings: [(setting, row indexes)] (one group with rows None: every row)."""
        if self.rows is None:
            self.groups = [(self._settings[0], None)]
            return
        groups = []
        for r, p in enumerate(self.rows):
            for setting, idx in groups:
                if setting.params == p:
                    idx.append(r)
                    break
            else:  # keep a setting's processing (its cached bias) while its rows stay
                setting = next((s for s in self._settings if s.params == p), None) or _OneSetting(p)
                groups.append((setting, [r]))
        self._settings = [s for s, _ in groups]
        self.groups = [(s, None) for s, _ in groups] if len(groups) == 1 else groups

    @property
    def params(self) -> SamplingParams | None:
        """The settings every row shares, or None when rows differ."""
        return self.groups[0][0].params if len(self.groups) == 1 else None

    @property
    def greedy(self) -> bool:
        """Every row is greedy."""
        return all(s.params.greedy for s, _ in self.groups)

    @property
    def forms(self) -> tuple[bool, bool, bool]:
        """The forms of the text so far the batch's processing reads (see SamplingParams.forms),
        as they were at its start."""
        return self._forms

    @property
    def uses_context(self) -> bool:
        return any(self.forms)

    def greedy_rows(self, device) -> torch.Tensor:
        """[B] bool: which of the batch's rows are greedy."""
        return torch.tensor([p.greedy for p in self.rows], device=device)

    row_fields = ("rows",)  # joins batches that keep the text in the same forms: see Batch.can_join

    def _select_more(self, rows: list[int]) -> None:
        self._group()

    def _join_more(self, other: "LogitsProcessing") -> None:
        self._settings += other._settings
        self._group()

    @property
    def computes_ahead(self) -> bool:
        """Some row's processors compute ahead (``prefetch``): the engine hands them a pass's texts."""
        return any(hasattr(f, "prefetch") for s, _ in self.groups for f in s.params.logits_processors)

    def prefetch(self, ctx: Context) -> bool:
        """Hand the processors that compute ahead (``prefetch(texts) -> ready``: a JSON schema's parser
        in a process of its own) the texts a pass will score, each its rows'; whether every answer
        has come."""
        ready, batch = True, len(self.rows) if self.rows is not None else None
        for setting, idx in self.groups:
            fns = [f for f in setting.params.logits_processors if hasattr(f, "prefetch")]
            if fns:
                texts = (ctx if idx is None else _rows_of(ctx, idx, batch)).token_ids
                for f in fns:
                    ready = f.prefetch(texts) and ready  # every one asked, ready or not
        return ready

    def connections(self) -> list:
        """What the processors that compute ahead wait on (``multiprocessing.connection.wait``)."""
        conns = (getattr(f, "connection", lambda: None)() for s, _ in self.groups for f in s.params.logits_processors)
        return [c for c in conns if c is not None]

    def _by_group(self, fn, x: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        if len(self.groups) == 1:
            return fn(self.groups[0][0], x, ctx)
        out = None
        for setting, idx in self.groups:
            part = fn(setting, x[idx], _rows_of(ctx, idx, x.shape[0]))
            if out is None:
                out = part.new_empty(x.shape[:-1] + part.shape[-1:])
            out[idx] = part
        return out

    def scores(self, logits: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        return self._by_group(lambda s, x, c: s.scores(x, c), logits, ctx)

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        return self._by_group(lambda s, x, c: s.warp(x), scores)

    def probs(self, logits: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        return self.warp(self.scores(logits, ctx))

    def logprob_source(self, scores: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """What logprobs report: for greedy rows log_softmax of the scores (the processed
        distribution at temperature 1), for sampled rows the log of what they were drawn from."""
        if probs is None or self.greedy:
            return scores.float().log_softmax(-1)
        logp = probs.float().log()
        if len(self.groups) > 1:
            greedy = self.greedy_rows(scores.device).view(-1, *[1] * (scores.dim() - 1))
            logp = torch.where(greedy, scores.float().log_softmax(-1), logp)
        return logp

    def pick(self, logits: torch.Tensor, ctx: Context | None, generator: torch.Generator | None,
             seeded: "SeededRows | None" = None, offset: int = 0):
        """Choose one token per row from logits [B, V]. Returns (tokens [B], probs or None). Seeded
        rows choose with their own noise for the token ``offset`` after their next one (a drafter's
        draft j: offset j), so a drafter close to the target picks what the target will."""
        if self.greedy:
            return argmax(self.scores(logits, ctx)), None
        probs = self.probs(logits, ctx)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        return (tokens if seeded is None else seeded.override(probs, tokens, offset)), probs


def token_logprobs(logp: torch.Tensor, tokens: torch.Tensor, count: list[int], top_n: list[int | None]) -> list:
    """Per row, the first count[b] positions: log p(token) and the top_n[b] alternatives under the
    processed target distribution (None for a row that asked for none). logp: [B, T, V]
    (``LogitsProcessing.logprob_source``). tokens: [B, T]."""
    most = max((n for n in top_n if n is not None), default=0)
    chosen = logp.gather(2, tokens[..., None]).squeeze(2).tolist()
    top_v, top_i = (logp.topk(min(most, logp.shape[-1]), dim=-1) if most > 0 else (None, None))
    top_v = top_v.tolist() if top_v is not None else None
    top_i = top_i.tolist() if top_i is not None else None
    out, toks = [], tokens.tolist()
    for b, n in enumerate(count):
        if top_n[b] is None:
            out.append(None)
            continue
        row = []
        for t in range(n):
            top = [] if not top_n[b] else [[i, v] for i, v in zip(top_i[b][t][: top_n[b]], top_v[b][t][: top_n[b]])
                                          if v > float("-inf")]
            row.append({"token": toks[b][t], "logprob": chosen[b][t], "top": top})
        out.append(row)
    return out


# ---- seeded rows: the Gumbel-max trick with noise keyed by position -------------------------------
# A seeded row draws its token at output index k as argmax(p_k / E_k), E_k ~ Exp(1) i.i.d. over the
# vocabulary, from a stream keyed by (the row's seed, k) alone: an exact sample from p_k (the
# exponential race is the Gumbel-max trick), fresh at every index. Verification then accepts a draft
# while it equals that choice (greedy-style, over the same processed p), so the row's text is a
# function of its prompt, settings and seed only: the same with any drafter, γ or batch companions,
# and the same as plain decoding with that seed (drafter-invariant speculative decoding, Daliri,
# Musco & Suresh 2024). For a drafter whose drafts are its own top choices (q one-hot) it accepts as
# often as rejection sampling does; unseeded rows keep rejection sampling (the best acceptance).

_MASK64 = (1 << 64) - 1


def _mix(a: int, b: int) -> int:
    """A 63-bit key from two integers (splitmix64's finaliser): nearby inputs give unrelated keys."""
    x = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row`` of a request seeded with ``seed`` (its n-th choice, its n-th prompt)."""
    return _mix(seed, row)


class SeededRows(PerRow):
    """Which rows of a batch are seeded, and the output index each one draws next."""

    row_fields = ("seeds", "next", "cache")

    def __init__(self, seeds: list[int | None], device):
        self.seeds, self.device = list(seeds), device
        self.next = [0] * len(seeds)  # output index of each row's next token to choose
        # per row, noise already drawn for indexes at or after its next one (a rejected draft's
        # index comes back next pass); at most KEEP of them, so memory stays bounded
        self.cache: list[dict[int, torch.Tensor]] = [{} for _ in seeds]

    KEEP = 4

    @property
    def any(self) -> bool:
        return any(s is not None for s in self.seeds)

    @property
    def mask(self) -> torch.Tensor:
        return torch.tensor([s is not None for s in self.seeds], device=self.device)

    def _exp_noise(self, seed: int, index: int, vocab: int) -> torch.Tensor:
        g = torch.Generator(device=self.device)
        g.manual_seed(_mix(seed, index))
        u = torch.rand(vocab, generator=g, device=self.device)
        return -torch.log(u.clamp_min(1e-38))  # u < 1, so E > 0

    def choose(self, probs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """probs [B, T, V] processed target probabilities; offsets [B, T]: how many tokens after the
        row's next one each position chooses (a chain: 0..T-1; a tree: a node's depth). Returns
        [B, T] choices (seeded rows: the race's winners; the others: p's argmax, unused)."""
        choice = argmax(probs)
        V = probs.shape[-1]
        for b, seed in enumerate(self.seeds):
            if seed is None:
                continue
            offs, cache = offsets[b].tolist(), self.cache[b]
            for k in set(offs):
                i = self.next[b] + k
                if i not in cache or cache[i].shape[0] != V:
                    cache[i] = self._exp_noise(seed, i, V)
            e = torch.stack([cache[self.next[b] + k] for k in offs])
            choice[b] = argmax(probs[b].float() / e)
            for i in sorted(cache)[self.KEEP:]:
                del cache[i]
        return choice

    def override(self, probs: torch.Tensor, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``tokens`` [B] drawn from probs [B, V], with the seeded rows' choices ``offset`` tokens after
        their next one put in instead."""
        if not self.any:
            return tokens
        offsets = torch.full((probs.shape[0], 1), offset, dtype=torch.long, device=probs.device)
        return torch.where(self.mask, self.choose(probs[:, None], offsets)[:, 0], tokens)

    def advance(self, counts: list[int]) -> None:
        """Row b's text grew by counts[b] tokens."""
        self.next = [k + c for k, c in zip(self.next, counts)]
        self.cache = [{i: e for i, e in c.items() if i >= k} for c, k in zip(self.cache, self.next)]


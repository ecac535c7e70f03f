"""``speculant check``: the exactness proof a user runs on their own target and drafter.

1. Greedy identity: each prompt's greedy text with speculation against plain decoding through the
   same engine, and against Hugging Face ``generate`` of the same target. Where the stats say
   ``"exact": "bitwise"`` (kernels proven width-invariant on this machine, any dtype) speculation
   must give plain decoding's text token for token: no near-tie excuse. Plain decoding (or, where
   the stats say "near-ties", speculation) may part from HF's own computation only at a rounding
   near-tie, listed with the reference's logit gap there: in float32 within float noise (1e-3), in
   bf16/fp16 within 4 rounding steps of the top logit; anything wider fails. A mode whose arithmetic
   is not HF's (``q8``: int8 activations) has its own text: there speculation must equal plain
   decoding token for token, and where plain decoding parts from HF ``generate`` is reported, not judged.
2. Sampling: ``samples`` continuations of one prompt (the user's first, or a built-in one whose
   answer repeats itself, so drafts are accepted) at temperature 1 (top-p/top-k as given),
   drafted with a fixed γ, against the target's own distribution. Each sampled token gets its
   randomised probability-integral transform under the target's exact conditional distribution
   (one forward pass over the sampled text, in the mode's own arithmetic: HF's forward, or the fast
   path's block in ``q8``): u = F(y-) + U·p(y). If the samples follow the target
   the u's are i.i.d. uniform on (0, 1) (the prequential PIT), whatever the vocabulary size, so
   a Kolmogorov-Smirnov test gives a p-value; a wrong acceptance rule shifts them.
Prints PASS/FAIL per check; the CLI exits 1 on any FAIL.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from . import files
from .errors import SpeculantError
from .models import gguf_model
from .sampling import LogitsProcessing, SamplingParams, TokenHistory

DEFAULT_PROMPTS = [
    "Write a haiku about rivers.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "Translate to French: The cat sleeps on the warm windowsill.",
]
# the sampling check's default prompt: text that repeats, so drafts get accepted and judged
SAMPLING_PROMPT = "Repeat this sentence three times: The quick brown fox jumps over the lazy dog."
P_THRESHOLD = 1e-3


@dataclass
class CheckResult:
    name: str
    passed: bool
    summary: str
    details: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.summary}"] + [f"      {d}" for d in self.details]


def near_tie_limit(dtype: torch.dtype, top_logit: float) -> float:
    """How far apart two logits may be and still be a rounding near-tie in this dtype."""
    if dtype in (torch.bfloat16, torch.float16):
        mantissa = 7 if dtype == torch.bfloat16 else 10
        return 4 * 2.0 ** (math.floor(math.log2(max(abs(top_logit), 1e-6))) - mantissa)
    return 1e-3


def _first_difference(ref: list[int], got: list[int], eos: set[int]) -> int | None:
    """Where two greedy texts part (None: the same, or ``got`` stopped at an EOS the other ran past)."""
    k = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if k is not None or len(ref) == len(got) or (len(got) < len(ref) and got and got[-1] in eos):
        return k
    return min(len(ref), len(got))


def own_arithmetic(gen) -> str | None:
    """The name of the generator's mode where its arithmetic is not HF's (``"q8"``: the fast path's
    int8 activations, whose text is its own), else None (HF's computation, up to rounding)."""
    fast = getattr(gen.backend, "fast", None)
    return "q8" if fast is not None and getattr(fast, "int8", False) else None


def greedy_check(gen, prompts: list[list[int]], max_new_tokens: int) -> CheckResult:
    model = gen.target.model
    device = next(model.parameters()).device
    eos = set(gen.target.eos_token_ids)
    mode = own_arithmetic(gen)
    direct = gguf_model.is_direct(model)
    identical = same_as_plain = 0
    details, ok, bitwise = [], True, True
    for i, ids in enumerate(prompts):
        got_out = gen.generate_ids([ids], max_new_tokens=max_new_tokens)[0]
        got = got_out.token_ids
        bitwise &= got_out.stats.get("exact") == "bitwise"
        plain = gen.generate_ids([ids], max_new_tokens=max_new_tokens, speculate=False)[0].token_ids
        if got_out.stats.get("exact") == "bitwise" or mode:
            k = _first_difference(plain, got, eos)
            if k is None:
                same_as_plain += 1
            else:
                ok = False
                why = ("the stats say its kernels are bitwise width-invariant" if got_out.stats.get("exact") == "bitwise"
                       else f"{mode} has no reference to call it a near-tie against")
                details.append(f"prompt {i}: speculation parts from plain decoding at new token {k} (plain "
                               f"{plain[k] if k < len(plain) else 'ended'}, speculant {got[k] if k < len(got) else 'ended'}): "
                               f"NOT allowed, {why}")
            got = plain  # what is compared with HF: the model's own computation
        if direct:  # no dense copy to run HF's generate on: speculation against plain decoding only
            continue
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 do_sample=False)[0, len(ids):].tolist()
        k = _first_difference(ref, got, eos)
        if k is None:
            identical += 1
            continue
        if mode:  # its own text: where it parts from HF's is told, not judged
            details.append(f"prompt {i}: plain decoding parts from HF generate at new token {k} (reference "
                           f"{ref[k] if k < len(ref) else 'ended'}, ours {got[k] if k < len(got) else 'ended'})")
            continue
        if k >= len(ref) or k >= len(got):
            ok = False
            details.append(f"prompt {i}: lengths differ (reference {len(ref)} tokens, speculant {len(got)})")
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids + ref[:k]], device=device)).logits[0, -1].float()
        top, gap = float(logits[ref[k]]), float(logits[ref[k]] - logits[got[k]])
        limit = near_tie_limit(model.dtype, top)
        tie = gap <= limit
        ok &= tie
        details.append(f"prompt {i}: {'plain decoding' if bitwise else 'speculant'} parts from HF generate at new "
                       f"token {k} (reference {ref[k]}, ours {got[k]}), reference logit gap {gap:.3g} "
                       f"({'a near-tie' if tie else 'NOT a near-tie'}: limit {limit:.3g})")
    summary = f"{identical}/{len(prompts)} prompts token-identical to HF generate"
    if direct:
        summary = ("read straight from its GGUF into the kernels, no dense copy for HF generate: not compared; load "
                   "it with dtype float32 to compare")
    if mode:
        return CheckResult("greedy identity", ok, f"{same_as_plain}/{len(prompts)} prompts: speculation identical to "
                           f"plain decoding in {mode}; {mode} is not HF's arithmetic, so its text is its own: plain "
                           f"decoding {summary} (told, not judged)", details)
    if bitwise:
        summary = (f"{same_as_plain}/{len(prompts)} prompts: speculation bit-identical to plain decoding "
                   f"(kernels width-invariant here); plain decoding " + summary)
    if identical < len(prompts) and ok:
        summary += " (the rest part at near-ties)"
    return CheckResult("greedy identity", ok, summary, details)


def sampling_check(gen, prompt: list[int], samples: int, new_tokens: int, gamma: int, seed: int,
                   sampling: dict, chunk: int = 64) -> CheckResult:
    from scipy.stats import kstest

    model = gen.target.model
    device = next(model.parameters()).device
    params = SamplingParams(**{"temperature": 1.0, **sampling})
    proc = LogitsProcessing(params, gen.engine.vocab_size)
    g = torch.Generator().manual_seed(seed)
    u_all, drafted, accepted = [], 0, 0
    for start in range(0, samples, chunk):
        rows = min(chunk, samples - start)
        # unseeded rows: rejection sampling against the drafter's q, the rule under check (seeded rows
        # race on noise of their own and never read q); repeatable through torch's seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + start)
            outs = gen.generate_ids([prompt] * rows, max_new_tokens=new_tokens, gamma=gamma, **params.__dict__)
        drafted += sum(o.stats["draft_tokens"] for o in outs)
        accepted += sum(o.stats["accepted_draft_tokens"] for o in outs)
        by_length: dict[int, list[list[int]]] = {}
        for o in outs:
            if o.token_ids:
                by_length.setdefault(len(o.token_ids), []).append(o.token_ids)
        for length, seqs in by_length.items():  # exact p(y_t | prompt, y_<t) for every sampled token
            y = torch.tensor(seqs)
            x = torch.cat([torch.tensor([prompt]).expand(len(seqs), -1), y], 1).to(device)
            logits = reference_logits(gen, x)[:, len(prompt) - 1 : -1]
            context = TokenHistory([prompt] * len(seqs), logits.shape[-1], device, params).block(y[:, :-1].to(device))
            p = proc.probs(logits, context).double().cpu()
            p_y = p.gather(2, y[..., None]).squeeze(2)
            below = torch.cumsum(p, -1).gather(2, y[..., None]).squeeze(2) - p_y
            u_all.append((below + torch.rand(y.shape, generator=g, dtype=torch.float64) * p_y).clamp(0, 1).flatten())
    u = torch.cat(u_all)
    pvalue = float(kstest(u.numpy(), "uniform").pvalue)
    alpha = accepted / drafted if drafted else 0.0
    passed = pvalue > P_THRESHOLD
    summary = (f"{len(u)} sampled tokens ({samples} samples x {new_tokens}) fit the target's own distribution: "
               f"KS p-value {pvalue:.3g} (fail below {P_THRESHOLD:g}); drafts accepted {alpha:.2f}")
    details = []
    if drafted == 0 or accepted == 0:
        details.append("warning: no draft token was accepted, so this check did not exercise speculation")
    return CheckResult("sampling distribution", passed, summary, details)


def reference_logits(gen, x: torch.Tensor) -> torch.Tensor:
    """Logits [B, n, V] at every position of ``x`` [B, n] in the mode's own arithmetic: HF's forward,
    or where that is not the mode's (``q8``) the fast path's block over a cache of its own (each row
    as a one-token step would compute it: the kernels are width-invariant)."""
    with torch.no_grad():
        if not own_arithmetic(gen):
            return gen.target.model(x).logits
        fast = gen.backend.fast
        keys, values = fast.new_cache(x.shape[0], x.shape[1])
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1).contiguous()
        return fast.forward(x, positions, positions, keys, values)


def run_check(gen, prompts: list[str] | None = None, samples: int = 400, max_new_tokens: int = 24,
              sample_tokens: int = 6, gamma: int = 4, seed: int = 0, chat_template: bool = True,
              sampling: dict | None = None) -> list[CheckResult]:
    if samples < 1:
        raise SpeculantError(f"--samples must be >= 1, got {samples}")
    ids = [gen.encode(t, chat_template) for t in prompts or DEFAULT_PROMPTS]
    sample_prompt = ids[0] if prompts else gen.encode(SAMPLING_PROMPT, chat_template)
    return [greedy_check(gen, ids, max_new_tokens),
            sampling_check(gen, sample_prompt, samples, sample_tokens, gamma, seed, sampling or {})]


PROMPT_FILE_BYTES = 16 << 20  # a prompt file's most bytes: far more prompts than a check runs


def read_prompt_file(path: str) -> list[str]:
    """One prompt a line, or JSONL lines with a "prompt" field (a bench suite). A FIFO or a device
    (``/dev/zero``) is refused at once, a file past PROMPT_FILE_BYTES before it is read whole."""
    text = files.read_text(files.as_path(path), "prompt file", limit=PROMPT_FILE_BYTES,
                           hint="give a text file of prompts, one a line")
    lines = [line for line in text.splitlines() if line.strip()]
    out = []
    for line in lines:
        if line.lstrip().startswith("{"):
            try:
                out.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError, RecursionError):
                raise SpeculantError(f"{path}: a JSON line without a \"prompt\" string: {line[:60]!r}") from None
        else:
            out.append(line)
    if not out:
        raise SpeculantError(f"the prompt file {path!r} has no prompts")
    return out

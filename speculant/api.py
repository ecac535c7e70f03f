"""The public API: ``Generator`` (a target and a drafter, ready to generate) and
``speculant.generate(hf_model, ...)``; ``speculant.load(...)`` -> Generator is in ``tools/loader.py``
(it measures ``--dtype auto`` with a Generator, from the layer above this one)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import psutil
import torch

from .drafters import Drafter, ModelDrafter, make_drafter
from .drafters.model import MODEL
from .drafters.registry import kind_of
from .engine import Batch, Engine, Request, Row, RowRequest, drain, seeded_row
from .errors import SpeculantError
from .limits import MAX_GAMMA, MAX_LOGPROBS, MEMORY_SHARE, check_int, check_stop, check_text, gib
from .models.backend import Backend
from .models.loading import LoadedModel
from .sampling import SamplingParams

GAMMA_AUTO = "auto"  # the default: chosen each pass from measured acceptance and costs (controller.py)


@dataclass
class Output:
    text: str
    token_ids: list[int]  # new tokens only
    prompt_token_ids: list[int]  # exactly what the target saw
    finish_reason: str | None
    stats: dict
    logprobs: list[dict] | None = None  # per token: {"token", "logprob", "top": [[id, logprob], ...]}


def check_gamma(gamma, most: int = MAX_GAMMA) -> int | str:
    if gamma == GAMMA_AUTO:
        return gamma
    if not isinstance(gamma, int) or isinstance(gamma, bool) or not 1 <= gamma <= most:
        raise SpeculantError(f"gamma (draft tokens per pass) must be 'auto' or an integer in 1..{most}, got {gamma!r}")
    return gamma


def _sampling_params(sampling: dict) -> tuple[SamplingParams, int | None]:
    """Checked (SamplingParams, logprobs) from keyword settings."""
    sampling = dict(sampling)
    logprobs = check_logprobs(sampling.pop("logprobs", None))
    try:
        return SamplingParams(**sampling), logprobs
    except TypeError as e:  # an unknown setting
        raise SpeculantError(f"unknown sampling setting: {e}") from None


def check_seed(seed, rows: int) -> None:
    """None, an integer (row r samples with row_seed(seed, r)), or one integer or None per prompt."""
    def ok(x):  # any integer: it is mixed into 63 bits (row_seed)
        return x is None or (isinstance(x, int) and not isinstance(x, bool))
    if isinstance(seed, list):
        if len(seed) != rows or not all(ok(x) for x in seed):
            raise SpeculantError(f"seed must be an integer, or a list of {rows} integers (or None), one per prompt; "
                                 f"got {str(seed)[:80]}")
    elif not ok(seed):
        raise SpeculantError(f"seed must be an integer, got {str(seed)[:80]}")


def check_logprobs(n) -> int | None:
    return n if n is None else check_int(n, "logprobs", 0, MAX_LOGPROBS, "alternatives per token")


def check_stops(stop) -> list:
    """One list of stop strings for every row, or (a list of lists) one per row; a string is one stop string."""
    return [check_stop(x) for x in stop] if _per_row(stop) else check_stop(stop)


FLAG_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def check_flag(value, name: str) -> bool:
    """A yes/no setting: a bool (or 0 / 1), or one of FLAG_WORDS in any case; anything else is refused
    (the string "false" is true to Python)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in FLAG_WORDS:
        return FLAG_WORDS[value.strip().lower()]
    raise SpeculantError(f"{name} must be true or false, got {str(value)[:80]!r}")


def check_prompt_ids(prompt_ids) -> list[list[int]]:
    """Prompts as token ids: a list of lists of ints (each checked against the vocabulary later)."""
    if (not isinstance(prompt_ids, (list, tuple))
            or not all(isinstance(p, (list, tuple)) for p in prompt_ids)):
        raise SpeculantError(f"prompt ids must be a list of prompts, each a list of token ids, got "
                             f"{type(prompt_ids).__name__}: for text use generate()")
    return [list(p) for p in prompt_ids]


def _stop_checker(tokenizer, stop: Sequence[str] | None) -> Callable | None:
    """Cut a row at the first stop string: returns how many tokens to keep (the one completing it included)."""
    if not stop:
        return None
    stops = [s for s in stop if s]

    def check(tokens: list[int]):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not any(s in text for s in stops):
            return None
        for k in range(1, len(tokens) + 1):  # the shortest prefix that contains a stop string
            if any(s in tokenizer.decode(tokens[:k], skip_special_tokens=True) for s in stops):
                return k
        return len(tokens)

    return check


def _rows_request(prompt_ids: list[list[int]], gamma, seed, cancelled, **settings) -> Request:
    """The engine's Request, each row's settings resolved once, here: ``settings`` values are one
    for every row or a list of one per row; a request's seed s gives row r the seed row_seed(s, r),
    a list of seeds is used as given; ``cancelled(row)`` becomes each row's own."""
    n = len(prompt_ids)
    columns = [list(v) if isinstance(v, list) else [v] * n for v in settings.values()]
    by_row = [dict(zip(settings, values)) for values in zip(*columns)]
    rows = [RowRequest(list(p), seed=(None if s["params"].greedy else seed[r]) if isinstance(seed, list)
                       else seeded_row(s["params"], seed, r),
                       cancelled=None if cancelled is None else functools.partial(cancelled, r), **s)
            for r, (p, s) in enumerate(zip(prompt_ids, by_row))]
    return Request(rows, gamma, seed=seed if isinstance(seed, int) else None)


def _per_row(stop) -> bool:
    """Stop strings given per row (a list of lists) rather than one list for every row."""
    return isinstance(stop, list) and any(isinstance(x, (list, tuple)) or x is None for x in stop)


def _cut_at_stop(text: str, stop: Sequence[str] | None) -> str:
    if not stop:
        return text
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


class Generator:
    """A target model with a drafter, ready to generate."""

    def __init__(self, target: LoadedModel, drafter: Drafter, gamma: int | str | None = None, path: str = "auto",
                 compile: bool = False, kernels: str | None = None):
        self.target = target
        self.drafter = drafter
        self.gamma = check_gamma(gamma) if gamma is not None else GAMMA_AUTO
        if isinstance(drafter, ModelDrafter) and drafter.follows_target_path:  # the drafter takes the target's path
            drafter.backend = Backend(drafter.model, path, compile, kernels=kernels)
        self.backend = Backend(target.model, path, compile, kernels=kernels)
        self.engine = Engine(target.model, drafter, target.eos_token_ids, target.context_length, self.backend)
        # the most memory one request's caches and logits may take (bytes): refused up front beyond it
        self.memory_budget = int(MEMORY_SHARE * free_memory(self.engine.device))

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            raise SpeculantError(f"the prompt must be text (a str), got {type(prompt).__name__}: "
                                 "for token ids use generate_ids()")
        if not prompt.strip():
            raise SpeculantError("the prompt is empty: give some text to continue")
        check_text(prompt, "the prompt")
        tok = self.tokenizer
        if check_flag(chat_template, "chat_template") and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tok(prompt, add_special_tokens=True)["input_ids"]
        return list(ids)

    def _request(self, prompt_ids, max_new_tokens, gamma, seed, stop, sampling, cancelled=None,
                 speculate: bool = True, row_sampling: list[dict] | None = None) -> Request:
        """A checked engine Request. ``max_new_tokens``, ``stop`` and ``seed`` may be lists, one per
        prompt; ``row_sampling``: one dict of sampling settings (and logprobs) per prompt, over ``sampling``."""
        row_sampling = sampling.pop("row_sampling", row_sampling)  # generate_ids(..., row_sampling=[...]) too
        if row_sampling is not None:
            if (not isinstance(row_sampling, list) or len(row_sampling) != len(prompt_ids)
                    or not all(isinstance(d, dict) for d in row_sampling)):
                raise SpeculantError(f"row_sampling must be a list of {len(prompt_ids)} dicts, one per prompt")
            rows = [_sampling_params(sampling | dict(d)) for d in row_sampling]
            params, logprobs = [p for p, _ in rows], [n for _, n in rows]
        else:
            params, logprobs = _sampling_params(sampling)
        for m in max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens]:
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise SpeculantError(f"max_new_tokens must be an integer >= 1, got {m!r}")
        limit = self.target.context_length
        prompt_ids = check_prompt_ids(prompt_ids)
        if not prompt_ids:
            raise SpeculantError("no prompts given: give at least one prompt (a list of token ids)")
        if isinstance(max_new_tokens, list) and len(max_new_tokens) != len(prompt_ids):
            raise SpeculantError(f"{len(max_new_tokens)} max_new_tokens for {len(prompt_ids)} prompts: give one per prompt")
        vocab = self.target.vocab_size
        for ids in prompt_ids:
            if not ids:
                raise SpeculantError("the prompt is empty: give some text to continue")
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise SpeculantError(f"prompt token ids must be integers in 0..{vocab - 1}: give token ids of the "
                                     "target's tokenizer")
            if len(ids) >= limit:
                raise SpeculantError(
                    f"the prompt is {len(ids)} tokens but the model's context is {limit} tokens: shorten the prompt"
                )
        check_seed(seed, len(prompt_ids))
        g = self.gamma if gamma is None else self.check_gamma(gamma)
        if self.drafter.name == "none" or not speculate:
            g = 0
        self.check_memory(len(prompt_ids), max(map(len, prompt_ids)), max(max_new_tokens) if isinstance(
            max_new_tokens, list) else max_new_tokens, g)
        stop = check_stops(stop)
        checks = ([_stop_checker(self.tokenizer, x) for x in stop] if _per_row(stop)
                  else [_stop_checker(self.tokenizer, stop)] * len(prompt_ids))
        return _rows_request(prompt_ids, g, params=params, max_new_tokens=max_new_tokens, seed=seed, stop=checks,
                             logprobs=logprobs, cancelled=cancelled)

    def check_gamma(self, gamma) -> int | str:
        """A γ setting this generator's drafter can use: "auto", or 1 up to what one proposal holds."""
        return check_gamma(gamma, min(MAX_GAMMA, self.drafter.max_gamma or MAX_GAMMA))

    @property
    def join_refusal(self) -> str | None:
        """Why a request cannot join a running batch of this generator's (its drafter keeps state
        a join would not carry; requests then batch in waves), or None where they can."""
        return self.drafter.join_refusal(self.backend.fast is not None)

    def memory_needed(self, rows: int, prompt_tokens: int, max_new_tokens: int, gamma: int | str,
                      extra_per_row: int = 0) -> int:
        """About how many bytes a request's caches (target and drafter) and a pass's logits take
        (the most a batch of it holds: every row at the longest prompt plus the most new tokens),
        with ``extra_per_row`` bytes of buffers per row (the server's streams, a schema's tables)."""
        width = 1 + (gamma if isinstance(gamma, int) else self.engine.most_auto_drafts)
        tokens = min(prompt_tokens + max_new_tokens, self.target.context_length) + 2 * width + 2
        caches = self.backend.state_bytes(rows, tokens) + self.drafter.state_bytes(rows, tokens)
        # a pass's logits: float32, about six copies (logits, processed, probabilities, a draft's q,
        # the penalties' per-position counts, what logprobs read); the longest prompt's prefill
        logits = 6 * rows * width * self.target.vocab_size * 4
        return caches + logits + self.backend.prefill_bytes(prompt_tokens) + rows * extra_per_row

    def idle_bytes(self) -> int:
        """Bytes of KV caches kept for reuse that no batch holds now (the target's and a draft model's)."""
        return sum(b.idle_bytes() for b in self._backends())

    def drop_idle(self) -> None:
        """Give back the KV caches kept for reuse that no batch holds."""
        for b in self._backends():
            b.drop_idle()

    def _backends(self) -> list[Backend]:
        found = [self.backend, getattr(self.drafter, "backend", None)]
        return [b for b in found if isinstance(b, Backend)]

    def check_memory(self, rows: int, prompt_tokens: int, max_new_tokens: int, gamma: int | str,
                     extra_per_row: int = 0) -> None:
        need = self.memory_needed(rows, prompt_tokens, max_new_tokens, gamma, extra_per_row)
        if need > self.memory_budget:
            raise SpeculantError(
                f"this request needs about {gib(need)} for its caches ({rows} rows of up to "
                f"{min(prompt_tokens + max_new_tokens, self.target.context_length)} tokens), more than the "
                f"{gib(self.memory_budget)} one request may use here: ask for fewer new tokens, fewer rows or a "
                "shorter prompt (or raise the budget: --max-request-memory, Generator.memory_budget)")

    def stream_ids(self, prompt_ids: list[list[int]], max_new_tokens=128, gamma=None, seed=None, stop=None,
                   speculate: bool = True, **sampling):
        """Yields (row, new token ids) as accepted; the generator's return value is the list of Rows.
        ``speculate=False``: plain decoding through the same engine and kernels."""
        req = self._request(prompt_ids, max_new_tokens, gamma, seed, stop, sampling, speculate=speculate)
        return self.engine.run(req)

    def start_batch(self, prompt_ids: list[list[int]], max_new_tokens: list[int], stops: list, gamma=None,
                    seed=None, cancelled=None, speculate: bool = True, row_sampling: list[dict] | None = None,
                    chunk=0, **sampling) -> Batch:
        """Prefill a batch to be stepped pass by pass (``engine.step``), joined between passes by
        other batches of the same γ setting (``engine.join``: continuous batching) and finished
        (``engine.finish``). A token budget, stop strings and seed per prompt (lists), sampling
        settings per prompt (``row_sampling``), ``cancelled(row) -> bool`` to end a row early;
        ``speculate=False``: plain decoding through the same engine. With ``chunk``: not the Batch
        but ``engine.start_steps``' generator, prefilling ``chunk`` prompt tokens a step (or as many as
        ``chunk()`` says before each step)."""
        req = self._request(prompt_ids, list(max_new_tokens), gamma, seed, [check_stop(x) for x in stops], sampling,
                            cancelled, speculate, row_sampling)
        return self.engine.start_steps(req, chunk) if chunk else self.engine.start(req)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def outputs(self, rows: list[Row], stop) -> list[Output]:
        """Outputs of finished rows; ``stop``: the stop strings (of all rows, or a list per row)."""
        outs = []
        for i, r in enumerate(rows):
            text = _cut_at_stop(self.decode(r.tokens), stop[i] if _per_row(stop) else stop)
            outs.append(Output(text, r.tokens, r.prompt, r.finish_reason, r.stats.to_dict(), r.logprobs))
        return outs

    def generate_ids(self, prompt_ids: list[list[int]], max_new_tokens=128, gamma=None, seed=None, stop=None,
                     speculate: bool = True, **sampling):
        stop = check_stops(stop)
        return self.outputs(drain(self.stream_ids(prompt_ids, max_new_tokens, gamma, seed, stop, speculate,
                                                  **sampling)), stop)

    def generate(
        self,
        prompt: str | list[str],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        gamma: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        chat_template: bool = True,
        **sampling,
    ) -> Output | list[Output]:
        """Generate for one prompt (-> Output) or a list of prompts (-> list of Output, batched).
        ``stop``: a stop string, or a list of them."""
        single = isinstance(prompt, str)
        if not single and not (isinstance(prompt, (list, tuple)) and all(isinstance(p, str) for p in prompt)):
            raise SpeculantError(f"the prompt must be text: a str or a list of str, got {_described(prompt)}"
                                 " (for token ids use generate_ids())")
        prompts = [prompt] if single else list(prompt)
        if not prompts:
            raise SpeculantError("no prompts given")
        ids = [self.encode(p, chat_template) for p in prompts]
        outs = self.generate_ids(ids, max_new_tokens, gamma, seed, stop, temperature=temperature, **sampling)
        return outs[0] if single else outs

    def stream(self, prompt: str, max_new_tokens=128, temperature=0.0, gamma=None, seed=None, stop=None,
               chat_template=True, origins: bool = False, **sampling) -> Iterator[str]:
        """Yields text pieces as tokens are accepted (one prompt). ``.last`` holds the final Output.
        ``origins=True``: yields (text, drafted) per token instead, drafted = a draft token the target
        accepted (False: the target's own token)."""
        ids = self.encode(prompt, chat_template)
        stop = check_stop(stop)
        it = self.stream_ids([ids], max_new_tokens, gamma, seed, stop, temperature=temperature, **sampling)
        text = TextStream(self.decode, stop)
        while True:
            try:
                _, new = next(it)
            except StopIteration as done:
                self.last = self.outputs(done.value, stop)[0]
                rest = text.finish(self.last.text)
                if rest:
                    yield (rest, False) if origins else rest
                return
            if origins:
                for k, t in enumerate(new):
                    piece = text.add([t])
                    if piece:
                        yield piece, k < new.from_draft
            else:
                piece = text.add(new)
                if piece:
                    yield piece


def _described(x) -> str:
    """What a wrong argument is, for an error: its type, and for a list the types in it."""
    if isinstance(x, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in x})
        return f"a {type(x).__name__} of {', '.join(kinds)}" if kinds else f"an empty {type(x).__name__}"
    return type(x).__name__


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device`` now, without swapping: a GPU's free memory; on a
    CPU the RAM the system calls available (free, and page cache it can drop), or where a
    container's memory cgroup sets a limit, that limit less the cgroup's usage (its page cache it
    can drop not counted), whichever is less."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = psutil.virtual_memory().available
    room = cgroup_room()
    return available if room is None else min(available, room)


def _read_number(path: str, key: str | None = None) -> int | None:
    try:
        with open(path) as f:
            text = f.read(1 << 16)
    except OSError:
        return None
    if key is None:
        text = text.strip()
        return int(text) if text.isdigit() else None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup can still take before its limit (v2 or v1); None where
    none sets a limit."""
    for limit_file, usage_file, stat_key in (("memory.max", "memory.current", "inactive_file"),
                                             ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                              "total_inactive_file")):
        limit = _read_number(f"{root}/{limit_file}")
        usage = _read_number(f"{root}/{usage_file}")
        if limit is None or usage is None or limit >= 1 << 60:  # "max", or v1's "unlimited"
            continue
        droppable = _read_number(f"{root}/{limit_file.rpartition('/')[0] + '/' if '/' in limit_file else ''}memory.stat",
                                 stat_key) or 0
        return max(0, limit - max(0, usage - droppable))
    return None


def _stop_prefix(text: str, stop: Sequence[str] | None) -> int:
    """The length of the longest end of ``text`` that begins a stop string."""
    return max((k for s in stop or () for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


class TextStream:
    """Text pieces of one row as its tokens arrive: cut at the first stop string, holding back half
    a multi-byte character, or the start of a stop string, until the rest of it comes.

    Incremental (as vLLM detokenises): each call decodes only the tokens since the last shown piece
    and one piece before them (so a leading space or a merged character comes out as it does in
    the whole text), not the whole row again: streaming costs stay linear in the answer's length."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] | None):
        self.decode, self.stop = decode, stop
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far (before any stop string cut)
        self.shown = ""
        self.prefix_at = self.read_at = 0  # tokens[prefix_at:read_at]: the piece before the unread ones

    def add(self, new_tokens: list[int]) -> str:
        self.tokens.extend(new_tokens)
        before = self.decode(self.tokens[self.prefix_at : self.read_at])
        window = self.decode(self.tokens[self.prefix_at :])
        if window.endswith("\ufffd") or len(window) <= len(before) or not window.startswith(before):
            return ""
        self.text += window[len(before) :]
        self.prefix_at, self.read_at = self.read_at, len(self.tokens)
        text = _cut_at_stop(self.text, self.stop)
        if text == self.text:  # hold back what may be the start of a stop string
            text = text[: len(text) - _stop_prefix(text, self.stop)]
        if not (text.startswith(self.shown) and len(text) > len(self.shown)):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def finish(self, final_text: str) -> str:
        """What is left to show of the row's final text."""
        rest = final_text[len(self.shown):] if final_text.startswith(self.shown) else ""
        self.shown = final_text
        return rest


def generate(model: torch.nn.Module, input_ids, drafter: str | Drafter | torch.nn.Module = "ngram",
             gamma: int | str | None = None, max_new_tokens: int = 128, seed: int | None = None,
             tokenizer=None, path: str = "auto", compile: bool = False, stop=None, **sampling):
    """Speculative generation for a transformers model already in memory.

    input_ids: a list of ids, a 1-D tensor, a list of lists or a 2-D tensor (rows without padding).
    drafter: "none" | "ngram" | a transformers draft model sharing the tokenizer | a Drafter.
    Returns an Output (one sequence) or a list of Output; ``text`` is empty unless a tokenizer is given.
    stop: a stop string or a list of them (needs the tokenizer).
    """
    if check_stop(stop) and tokenizer is None:
        raise SpeculantError("stop strings need the model's tokenizer: pass tokenizer=")
    if not isinstance(model, torch.nn.Module):
        raise SpeculantError(f"model must be a loaded transformers model (a torch.nn.Module), got "
                             f"{type(model).__name__}: for a model folder or .gguf use speculant.load()")
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() not in (1, 2) or input_ids.dtype.is_floating_point:
            raise SpeculantError(f"input_ids must be a 1-D or 2-D tensor of token ids, got {input_ids.dim()}-D "
                                 f"{str(input_ids.dtype).removeprefix('torch.')}")
        single = input_ids.dim() == 1
        rows = [input_ids.tolist()] if single else input_ids.tolist()
    elif isinstance(input_ids, (list, tuple)):
        single = bool(input_ids) and not isinstance(input_ids[0], (list, tuple))
        rows = [list(input_ids)] if single else list(input_ids)
    else:
        raise SpeculantError(f"input_ids must be token ids (a list, a list of lists or a tensor), got "
                             f"{type(input_ids).__name__}")
    target = LoadedModel(model=model.eval(), tokenizer=tokenizer, name=type(model).__name__)
    if isinstance(drafter, torch.nn.Module):
        d_vocab, t_vocab = drafter.config.vocab_size, model.config.vocab_size
        if d_vocab != t_vocab:
            raise SpeculantError(
                f"drafter vocabulary ({d_vocab} tokens) differs from the target's ({t_vocab} tokens): "
                "use a draft model with the target's tokenizer"
            )
        drafter = ModelDrafter(drafter.eval(), label=type(drafter).__name__)
    elif isinstance(drafter, str) and kind_of(drafter) is MODEL:
        raise SpeculantError("speculant.generate takes a loaded draft model object, not 'model:PATH'")
    gen = Generator(target, make_drafter(drafter, target), gamma, path, compile)
    outs = gen.generate_ids(rows, max_new_tokens, None, seed, stop, **sampling)
    return outs[0] if single else outs

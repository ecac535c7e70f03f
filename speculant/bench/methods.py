"""The methods a benchmark compares, one runner each; every call returns one raw record.

A record is one generate call (one batch of prompts) of one method under one setting:
wall-clock seconds measured here the same way for every method (CUDA synchronised), peak memory,
and per prompt row the new token ids and the counters the metrics are computed from.
"""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..api import Generator
from ..drafters import check_spec, make_drafter, parse_spec
from ..drafters.base import sync
from ..drafters.model import load_draft
from ..errors import SpeculantError
from ..models import gguf_model
from ..models.loading import resolve_device, resolve_model_path
from ..tools.loader import load
from . import peers as peer_runtimes
from .machine import what_ran
from .prompts import BenchPrompt

HF_GENERATE = "hf generate"
SPECULANT_NONE = "speculant none"
AUTO = "auto"


HF_PROMPT_LOOKUP_AUTO = 10  # Hugging Face's documented choice for prompt_lookup_num_tokens


def gamma_for_engine(gamma):
    """Map a γ label to what Generator takes: ``auto`` is speculant's adaptive controller."""
    return AUTO if gamma == AUTO else int(gamma)


@dataclass(frozen=True)
class Method:
    name: str  # "hf generate", "hf assisted ngram", "speculant model:PATH", "llama.cpp", ...
    kind: str  # "hf" | "hf_assisted" | "speculant" | "peer" (another runtime on the same GGUF: bench/peers.py)
    drafter: str  # "none" | "ngram" | "model:PATH"

    @property
    def uses_gamma(self) -> bool:
        return self.drafter != "none"


def methods_for(drafters: list[str], peers: list[str] = (), hf: bool = True) -> list[Method]:
    """HF generate and speculant none always (HF's only with ``hf``: a target with a dense model); per
    drafter: speculant, and HF assisted generation where Hugging Face has the same drafter (prompt
    lookup for ngram, assistant_model for model:PATH); then each peer runtime's modes (bench/peers.py)."""
    out = ([Method(HF_GENERATE, "hf", "none")] if hf else []) + [Method(SPECULANT_NONE, "speculant", "none")]
    for d in drafters:
        spec = check_spec(d)
        if spec.kind == "none":
            continue
        if hf and (spec.text == "ngram" or spec.kind == "model"):
            out.append(Method(f"hf assisted {d}", "hf_assisted", d))
        out.append(Method(f"speculant {d}", "speculant", d))
    return out + [Method(name, "peer", "none") for name in peer_runtimes.method_names(list(peers))]


@dataclass(frozen=True)
class Setting:
    gamma: object  # int, "auto", or None for methods without a drafter
    temperature: float
    batch_size: int


class PeakMemory:
    """Peak memory during a block. GPU: CUDA max allocated. CPU (Linux): the process's peak RSS
    (VmHWM), reset at the start by writing 5 to /proc/self/clear_refs, so it costs nothing while
    the block runs (a sampling thread would slow small models down measurably). Elsewhere: the
    peak RSS of the whole process so far (``kind`` says which)."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self.start = device, 0, 0
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "process_peak_rss"

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = int(torch.cuda.memory_allocated(self.device))
            return self
        self.start = _proc_status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.kind = "process_peak_rss_since_start"
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self.kind == "process_peak_rss":
            self.peak = _proc_status("VmHWM")
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak = int(rss if sys.platform == "darwin" else rss * 1024)
        return False

    @property
    def above_start(self) -> int:
        """What the block itself added on top of what was live when it began (weights, caches)."""
        return max(0, self.peak - self.start)


def _proc_status(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CountCalls:
    """Counts forward passes of a module (HF generate's target passes: τ for HF assisted generation)."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.count = module, 0

    def __enter__(self):
        self._handle = self.module.register_forward_pre_hook(self._hook)
        return self

    def _hook(self, *_):
        self.count += 1

    def __exit__(self, *exc):
        self._handle.remove()
        return False


class MethodRunner:
    """Holds the target, one speculant Generator per drafter and the HF assistant models."""

    def __init__(self, target: str = "default", drafters: list[str] = (), device=None, dtype=None,
                 chat_template: bool = True, path: str = "auto", peers: list[str] = ()):
        if dtype is None and resolve_device(device).type == "cpu":
            # comparable across machines ("auto" picks the fastest exact dtype here); a GGUF the int8
            # kernels read directly runs on them (a float32 copy of a 1.5B model is 7 GB)
            target_path = resolve_model_path(target)
            dtype = "q8" if target_path.is_file() and gguf_model.reads_directly(target_path) else "float32"
        base = load(target, drafter="none", device=device, dtype=dtype, path=path)
        self.target = base.target
        # Hugging Face's generate and assisted generation need the dense model a GGUF read straight into
        # the kernels does not have: plain decoding is then the baseline (and the greedy reference)
        self.hf = not gguf_model.is_direct(self.target.model)
        self.device = self.target.device
        self.chat_template = chat_template
        self.generators: dict[str, Generator] = {"none": base}
        self.assistants: dict[str, torch.nn.Module] = {}
        self.assistant_tokenizers: dict[str, object] = {}  # drafters with another tokenizer
        for d in drafters:
            if d in self.generators:
                continue
            drafter = make_drafter(d, self.target)
            if hasattr(drafter, "forget_same_prompt"):
                # suffix keeps earlier outputs for later requests; a prompt run again (warm-up, repeats,
                # other settings) must not draft from its own earlier output: a bench measures new requests
                drafter.forget_same_prompt = True
            self.generators[d] = Generator(self.target, drafter, path=path)
            spec = parse_spec(d)
            if spec.kind == "model" and self.hf:
                # make_drafter's load is memoised: this is the very model speculant drafts with
                loaded = load_draft(spec.arg, self.target)
                self.assistants[d] = loaded.model
                if loaded.vocab_size != self.target.vocab_size:  # HF's universal assisted generation
                    self.assistant_tokenizers[d] = loaded.tokenizer
        self.peers = {}
        if peers:
            gguf = resolve_model_path(target)
            if not gguf.is_file() or self.device.type != "cpu":
                raise SpeculantError("--peers runs other runtimes on the target's .gguf file on the CPU: give a "
                                     ".gguf target (or 'default') and --device cpu, or --peers none")
            context = self.target.context_length
            drafts = [parse_spec(d).arg for d in drafters if parse_spec(d).kind == "model"]
            draft = next((Path(a) for a in drafts if resolve_model_path(a).is_file()), None)
            names = peer_runtimes.method_names(peers)
            if "llama.cpp draft model" in names and draft is None:
                raise SpeculantError("the llama.cpp-draft peer runs llama.cpp's draft-model speculation with the bench's "
                                     "model:FILE.gguf drafter: give one in --drafters, or leave the peer out")
            self.peers = {name: peer_runtimes.load(name, gguf, context, resolve_model_path(str(draft)) if draft else None,
                                                   self.target.tokenizer) for name in names}
        tok = self.target.tokenizer
        eos = self.target.eos_token_ids
        self.eos = eos
        pad = getattr(tok, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.target.model.generation_config, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (min(eos) if eos else 0)

    def what_ran(self) -> dict:
        """Each speculant method's drafter, dtype, path and kernels, as its Generator runs them."""
        return {SPECULANT_NONE if d == "none" else f"speculant {d}": what_ran(g) for d, g in self.generators.items()}

    def encode(self, prompt: BenchPrompt) -> list[int]:
        return self.generators["none"].encode(prompt.prompt, self.chat_template)

    def resolved_gamma(self, method: Method, gamma) -> int | str | None:
        """The γ a call uses (an int, or "auto"), None without a drafter."""
        return gamma_for_engine(gamma) if method.uses_gamma else None

    def run(self, method: Method, setting: Setting, batch: list[BenchPrompt], ids: list[list[int]],
            max_new_tokens: int, seed: int) -> dict:
        """One timed call; returns the raw record."""
        runner = {"speculant": self._speculant, "peer": self._peer}.get(method.kind, self._hf)
        sync(self.device)
        with PeakMemory(self.device) as mem:
            t0 = time.perf_counter()
            rows, extra = runner(method, setting, ids, max_new_tokens, seed)
            sync(self.device)
            seconds = time.perf_counter() - t0
        for row, p in zip(rows, batch):
            row["prompt_id"], row["category"] = p.id, p.category
        return {
            "method": method.name, "kind": method.kind, "drafter": method.drafter,
            "gamma": setting.gamma, "gamma_used": self.resolved_gamma(method, setting.gamma),
            "temperature": setting.temperature, "batch_size": setting.batch_size,
            "max_new_tokens": max_new_tokens, "seed": seed,
            "seconds": seconds, "peak_memory_bytes": mem.peak, "peak_memory_above_start_bytes": mem.above_start,
            "memory_kind": mem.kind,
            "rows": rows, **extra,
        }

    def _speculant(self, method, setting, ids, max_new_tokens, seed):
        gen = self.generators[method.drafter]
        gamma = gamma_for_engine(setting.gamma) if method.uses_gamma else None
        outs = gen.generate_ids(ids, max_new_tokens, gamma=gamma, seed=seed, temperature=setting.temperature)
        rows = []
        for o in outs:
            s = o.stats
            rows.append({
                "token_ids": list(o.token_ids), "new_tokens": s["new_tokens"],
                "target_forward_passes": s["target_forward_passes"],
                "draft_tokens": s["draft_tokens"], "accepted_draft_tokens": s["accepted_draft_tokens"],
                "acceptance_by_position": list(s["acceptance_by_position"]),
                "engine_seconds": s["seconds"], "drafter_seconds": s["drafter_seconds"],
                "target_seconds": s["target_seconds"], "finish_reason": o.finish_reason,
                "tree_passes": s.get("tree_passes", 0), "tree_nodes": s.get("tree_nodes", 0),
            })
        return rows, {}

    def _peer(self, method, setting, ids, max_new_tokens, seed):
        if len(ids) > 1 or setting.temperature > 0:
            raise SpeculantError(f"{method.name} runs greedy at batch size 1 only in a bench")
        peer = self.peers[method.name]
        out = peer.generate(ids[0], max_new_tokens, self.eos)
        stats = getattr(peer, "stats", {})
        row = {"token_ids": out, "new_tokens": len(out), "target_forward_passes": None,
               "draft_tokens": stats.get("drafted"), "accepted_draft_tokens": stats.get("accepted"),
               "acceptance_by_position": None}
        # a peer that runs as a process a prompt reports its own times (its models' loading not counted)
        return [row], ({"seconds": peer.seconds} if getattr(peer, "seconds", None) is not None else {})

    def _hf(self, method, setting, ids, max_new_tokens, seed):
        model = self.target.model
        width = max(len(r) for r in ids)
        x = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for i, r in enumerate(ids):  # left padding: every row's next token is at the same column
            x[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        kwargs = dict(input_ids=x.to(self.device), attention_mask=mask.to(self.device),
                      max_new_tokens=max_new_tokens, pad_token_id=self.pad_token_id)
        if setting.temperature > 0:
            kwargs.update(do_sample=True, temperature=setting.temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        gamma = self.resolved_gamma(method, setting.gamma)
        assistant = contextlib.nullcontext()
        if method.kind == "hf_assisted":
            if len(ids) > 1:
                raise SpeculantError("Hugging Face assisted generation supports batch size 1 only")
            if method.drafter == "ngram":
                kwargs["prompt_lookup_num_tokens"] = HF_PROMPT_LOOKUP_AUTO if gamma == AUTO else gamma
            else:
                kwargs["assistant_model"] = self.assistants[method.drafter]
                if method.drafter in self.assistant_tokenizers:
                    kwargs.update(tokenizer=self.target.tokenizer,
                                  assistant_tokenizer=self.assistant_tokenizers[method.drafter])
                if gamma != AUTO:  # auto: HF's own heuristic schedule of assistant tokens
                    assistant = _constant_gamma(self.assistants[method.drafter], gamma)
        torch.manual_seed(seed)
        with torch.no_grad(), assistant, CountCalls(model) as calls:
            out = model.generate(**kwargs)
        rows = []
        for r in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(r) if t in self.eos), len(r))  # EOS kept, padding dropped
            rows.append({"token_ids": r[:cut], "new_tokens": cut, "target_forward_passes": calls.count,
                         "draft_tokens": None, "accepted_draft_tokens": None, "acceptance_by_position": None})
        return rows, {}


@contextlib.contextmanager
def _constant_gamma(assistant: torch.nn.Module, gamma: int):
    """HF reads γ from the assistant's generation_config; fix it at γ (no heuristic schedule)."""
    cfg = assistant.generation_config
    saved = (getattr(cfg, "num_assistant_tokens", None), getattr(cfg, "num_assistant_tokens_schedule", None))
    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = gamma, "constant"
    try:
        yield
    finally:
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = saved

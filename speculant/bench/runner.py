"""The run plan: which (method, setting) pairs each sweep needs, warm-ups, repeats, rotated order."""
from __future__ import annotations

from dataclasses import dataclass, field

from .methods import AUTO, HF_GENERATE, SPECULANT_NONE, Method, MethodRunner, Setting, methods_for
from .prompts import BenchPrompt


@dataclass
class BenchConfig:
    target: str = "default"
    drafters: list[str] = field(default_factory=lambda: ["ngram"])
    gammas: list = field(default_factory=lambda: [AUTO])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    max_new_tokens: int = 128
    repeats: int = 1
    warmup: int = 1
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    path: str = "auto"  # speculant's forward: auto | fast | general
    chat_template: bool = True
    peers: list[str] = field(default_factory=list)  # other runtimes on the same GGUF (bench/peers.py)
    hf: bool = True  # HF generate and assisted generation run (not on a GGUF read straight into the kernels)

    @property
    def primary(self) -> Setting:
        """The main comparison: greedy if asked for, batch 1, the drafters' default γ unless one γ is given."""
        gamma = self.gammas[0] if len(self.gammas) == 1 else AUTO
        temperature = 0.0 if 0.0 in self.temperatures else self.temperatures[0]
        return Setting(gamma, temperature, 1)


def plan(config: BenchConfig) -> list[tuple[Method, Setting]]:
    """Unique (method, setting) pairs. Sweeps run only what they need: the γ sweep only speculant
    drafters; the temperature and batch sweeps the two baselines and speculant drafters (HF assisted
    generation and peer runtimes are batch 1 only, and compared where it matters, in the primary
    run; peers only when it is greedy)."""
    methods = methods_for(config.drafters, config.peers if config.primary.temperature == 0 else [], config.hf)
    p = config.primary
    pairs: dict[tuple, tuple[Method, Setting]] = {}

    def add(m: Method, gamma, temperature, batch):
        s = Setting(gamma if m.uses_gamma else None, temperature, batch)
        pairs.setdefault((m.name, s), (m, s))

    for m in methods:
        add(m, p.gamma, p.temperature, 1)
    drafted = [m for m in methods if m.kind == "speculant" and m.uses_gamma]
    if len(config.gammas) > 1:
        for g in config.gammas:
            for m in drafted:
                add(m, g, p.temperature, 1)
    sweep_methods = [m for m in methods if m.name in (HF_GENERATE, SPECULANT_NONE)] + drafted
    if len(config.temperatures) > 1:
        for t in config.temperatures:
            for m in sweep_methods:
                add(m, p.gamma, t, 1)
    if len(config.batch_sizes) > 1:
        for b in config.batch_sizes:
            for m in sweep_methods:
                add(m, p.gamma, p.temperature, b)
    # greedy output equality needs the reference's greedy batch-1 output on every prompt (HF generate's,
    # else plain decoding's)
    add(methods[0], None, 0.0, 1)
    return list(pairs.values())


def batches(prompts: list[BenchPrompt], size: int) -> list[list[BenchPrompt]]:
    """Batch 1: one call per prompt. Larger: consecutive prompts, the last batch filled by cycling
    from the start so every call runs at the batch size it is reported under."""
    if size == 1:
        return [[p] for p in prompts]
    out = []
    for i in range(0, len(prompts), size):
        b = prompts[i:i + size]
        k = 0
        while len(b) < size:
            b.append(prompts[k % len(prompts)])
            k += 1
        out.append(b)
    return out


def count_calls(config: BenchConfig, prompts: list[BenchPrompt], pairs) -> int:
    calls = 0
    for _, s in pairs:
        calls += config.warmup + config.repeats * len(batches(prompts, s.batch_size))
    return calls


def run_benchmark(config: BenchConfig, prompts: list[BenchPrompt], runner: MethodRunner | None = None,
                  progress=None) -> list[dict]:
    """Run the plan; returns every raw record. ``progress(n)`` is called after each call (warm-ups too).

    Calls are grouped by (temperature, batch size); within a group every prompt batch is run by
    all methods back to back, in an order rotated per batch and repeat so drift favours none."""
    runner = runner or MethodRunner(config.target, config.drafters, config.device, config.dtype,
                                    chat_template=config.chat_template, path=config.path, peers=config.peers)
    config.hf = runner.hf
    pairs = plan(config)
    ids = {p.id: runner.encode(p) for p in prompts}
    groups: dict[tuple, list] = {}
    for m, s in pairs:
        groups.setdefault((s.temperature, s.batch_size), []).append((m, s))
    records = []
    for (temperature, size), group in groups.items():
        prompt_batches = batches(prompts, size)
        for m, s in group:  # warm-ups: kernels, allocator, caches; not recorded
            for _ in range(config.warmup):
                b = prompt_batches[0]
                runner.run(m, s, b, [ids[p.id] for p in b], config.max_new_tokens, config.seed)
                if progress:
                    progress(1)
        for rep in range(config.repeats):
            for bi, b in enumerate(prompt_batches):
                shift = (bi + rep) % len(group)
                for m, s in group[shift:] + group[:shift]:
                    seed = config.seed + 1000 * rep + b[0].id  # same seed for every method on a batch
                    rec = runner.run(m, s, b, [ids[p.id] for p in b], config.max_new_tokens, seed)
                    rec["repeat"], rec["batch_index"] = rep, bi
                    records.append(rec)
                    if progress:
                        progress(1)
    return records

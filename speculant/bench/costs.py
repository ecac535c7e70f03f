"""Cost structure of decoding: bandwidth floor, plain decoding, verification cost by width,
drafter step cost, speculative effective ms/token, peak memory (issue: the fast path).

    python -m speculant.bench.costs --device cuda --shapes llama-1b,llama-8b --out DIR
    python -m speculant.bench.costs --device cpu --shapes default --out DIR

Shapes ``llama-1b`` / ``llama-8b`` are Llama-3.2-1B / Llama-3.1-8B configurations with RANDOM
weights: they show the cost structure only; acceptance on them is meaningless. For a controlled
acceptance rate the *oracle* drafter proposes the target's own greedy tokens, corrupting each with
probability 1 - α, while a real draft model runs alongside so its cost is paid (rows labelled).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ..api import Generator, drain
from ..drafters import ModelDrafter, NgramDrafter, NoDrafter
from ..drafters.base import Drafter, Proposal, sync
from ..engine import Engine, Request
from ..models import cpu_kernels
from ..models.backend import Backend
from ..models.loading import load_model
from ..sampling import SamplingParams
from .machine import machine_info

SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
}


def timed(fn, device, repeats=10, warmup=3) -> float:
    """Median milliseconds of fn() (synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device, megabytes=1024) -> float:
    """GB/s of a device-to-device copy, counting bytes read and written."""
    n = megabytes * 2**20 // 4
    a = torch.randn(n, device=device)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), device, repeats=10)
    return 2 * a.numel() * 4 / (ms / 1e3) / 1e9


def random_llama(shape: str, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM  # a second or more to import: only when used

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rope_theta=500000.0)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def run_engine(target, drafter, backend, prompt, n, gamma, eos=()):
    engine = Engine(target, drafter, set(eos), 1 << 20, backend)
    return drain(engine.run(Request.same([prompt], SamplingParams(), n, gamma)))[0]


def decode_ms_per_token(model, backend, prompt, n, device, repeats=3) -> float:
    """Plain decoding's ms per token after the prefill (median of runs; a slow prefill's jitter,
    seconds in bf16 without oneDNN bf16, stays out of it)."""
    run_engine(model, NoDrafter(), backend, prompt, n, 1)  # warm-up
    times = []
    for _ in range(repeats):
        st = run_engine(model, NoDrafter(), backend, prompt, n, 1).stats
        times.append((st.seconds - st.first_token_seconds) / (n - 1) * 1e3)
    return statistics.median(times)


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation, each token corrupted with probability 1 - α;
    a real draft model (``cost``) drafts alongside so the measured time includes a drafter's cost."""

    name = "oracle"

    def __init__(self, reference: list[int], alpha: float, vocab: int, cost: Drafter | None = None, seed=0):
        self.reference, self.alpha, self.vocab, self.cost = reference, alpha, vocab, cost
        self.g = torch.Generator().manual_seed(seed)

    def describe(self):
        return f"oracle(α={self.alpha})" + (f"+cost:{self.cost.describe()}" if self.cost else "")

    def start(self, ctx):
        self.ctx, self.done = ctx, len(ctx.prompts[0]) * 0
        self.pos = 0
        if self.cost:
            self.cost.start(ctx)

    def propose(self, gamma):
        if self.cost:
            self.cost.propose(gamma)
        toks = list(self.reference[self.pos : self.pos + gamma])
        for j in range(len(toks)):
            if torch.rand(1, generator=self.g).item() > self.alpha:
                toks[j] = (toks[j] + 1 + int(torch.randint(0, self.vocab - 1, (1,), generator=self.g))) % self.vocab
        t = torch.zeros(1, gamma, dtype=torch.long)
        t[0, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        return Proposal(t.to(self.ctx.device), torch.tensor([len(toks)], device=self.ctx.device), None)

    def update(self, new_tokens, n_accepted):
        self.pos += len(new_tokens[0])
        if self.cost:
            self.cost.update(new_tokens, n_accepted)

    row_fields = ("cost",)  # the wrapped drafter's rows (PerRow)


def verify_costs(backend, prompt, device, widths, vocab, repeats=20) -> dict[int, float]:
    """Median ms of one verify pass of k tokens at a context of len(prompt), widths interleaved so a
    slow moment of the machine does not land on one width."""
    state = backend.new_state(1, len(prompt) + max(widths) + 8)
    state.append(torch.tensor([prompt], device=device))
    base = state.lengths()
    blocks = {k: torch.randint(0, vocab, (1, k), device=device) for k in widths}
    times = {k: [] for k in widths}
    for rep in range(repeats + 3):
        for k, block in blocks.items():
            sync(device)
            t = time.perf_counter()
            state.append(block)
            sync(device)
            if rep >= 3:  # warm-up rounds
                times[k].append((time.perf_counter() - t) * 1e3)
            state.rollback(base)
    return {k: statistics.median(v) for k, v in times.items()}


def hf_ms_per_token(model, prompt, n, device, repeats=3, **kw) -> float:
    """HF generate's ms per token after the prefill: a logits processor stamps the time of each
    step's scores, so the prefill (and its jitter) stays out, as in ``decode_ms_per_token``."""
    from transformers import LogitsProcessorList  # a second or more to import: only when used

    stamps: list[float] = []

    def clock(ids, scores):
        sync(device)
        stamps.append(time.perf_counter())
        return scores

    x = torch.tensor([prompt], device=device)
    times = []
    for rep in range(repeats + 1):
        stamps.clear()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       logits_processor=LogitsProcessorList([clock]), **kw)
        sync(device)
        if rep:  # the first run warms up
            times.append((time.perf_counter() - stamps[0]) / (n - 1) * 1e3)
    return statistics.median(times)


def shape_costs(shape, device, dtype, bandwidth, n=64, prompt_len=128, log=print, compile=False) -> dict:
    model = random_llama(shape, device, dtype)
    vocab = model.config.vocab_size
    backend = Backend(model, "fast", compile=compile)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    wbytes = weight_bytes(model)
    row = {"shape": shape, "backend": backend.name, "weights_bytes": wbytes,
           "floor_ms_per_token": wbytes / (bandwidth * 1e9) * 1e3,
           "note": "random weights: cost structure only, acceptance meaningless"}
    row["ours_plain_ms_per_token"] = decode_ms_per_token(model, backend, prompt, n, device)
    log(f"  {shape}: floor {row['floor_ms_per_token']:.2f} ms, ours plain {row['ours_plain_ms_per_token']:.2f} ms/token")
    row["hf_plain_ms_per_token"] = hf_ms_per_token(model, prompt, min(n, 32), device)
    log(f"  {shape}: HF generate {row['hf_plain_ms_per_token']:.2f} ms/token")
    # verification cost by block width k, at a context of prompt_len tokens
    costs = verify_costs(backend, prompt, device, range(1, 17), vocab)
    row["verify_ms_by_k"] = costs
    row["verify_8_over_1"] = costs[8] / costs[1]
    log(f"  {shape}: verify k=1 {costs[1]:.2f} ms, k=8 {costs[8]:.2f} ms (x{row['verify_8_over_1']:.2f})")
    if device.type == "cuda":
        row["peak_gpu_bytes_target_alone"] = torch.cuda.max_memory_allocated()
    return row, model, backend, prompt


def as_bigram_model(model) -> None:
    """Zero the residual-branch outputs (o_proj, down_proj): the model's next token then depends on the
    current token alone, with logit gaps far above bf16 noise, so an oracle can know the target's greedy
    choice even when verification runs at another width. Dense kernels cost the same on zeros' bytes."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def speculative_costs(target, t_backend, drafter_model, prompt, device, n=64, alpha=0.8, gamma=5, log=print,
                      compile=False) -> dict:
    vocab = target.config.vocab_size
    as_bigram_model(target)
    ref = run_engine(target, NoDrafter(), t_backend, prompt, n + gamma + 2, 1).tokens
    d_backend = Backend(drafter_model, "fast", compile=compile)
    d_state = d_backend.new_state(1, len(prompt) + 64)
    d_state.append(torch.tensor([prompt], device=device))
    base = d_state.lengths()
    one = torch.randint(0, vocab, (1, 1), device=device)

    def dstep():
        d_state.append(one)
        d_state.rollback(base)

    out = {"drafter_step_ms": timed(dstep, device, repeats=20)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def oracle(k):
        return run_engine(target, OracleDrafter(ref, alpha, vocab, ModelDrafter(drafter_model, backend=d_backend)),
                          t_backend, prompt, k, gamma)

    r = oracle(n)
    out.update({"oracle_alpha": alpha, "gamma": gamma, "measured_acceptance": r.stats.acceptance_rate,
                "measured_tau": r.stats.mean_accepted_tokens,
                "speculative_ms_per_token": timed(lambda: oracle(n), device, repeats=3, warmup=1) / n,
                "label": f"oracle drafter α={alpha} (target's own tokens, corrupted), real draft model's cost paid; "
                         "target's residual outputs zeroed so its greedy choice is stable (same cost)"})
    if device.type == "cuda":
        out["peak_gpu_bytes_target_drafter_caches"] = torch.cuda.max_memory_allocated()
    # the same pair with the real draft model's proposals, ours vs Hugging Face assisted generation
    ours = timed(lambda: run_engine(target, ModelDrafter(drafter_model, backend=d_backend), t_backend, prompt, n, gamma),
                 device, repeats=3, warmup=1) / n
    x = torch.tensor([prompt], device=device)
    hf = timed(lambda: target.generate(x, attention_mask=torch.ones_like(x), assistant_model=drafter_model,
                                       max_new_tokens=n, min_new_tokens=n, do_sample=False),
               device, repeats=2, warmup=1) / n
    out.update({"ours_model_drafter_ms_per_token": ours, "hf_assisted_ms_per_token": hf,
                "speedup_vs_hf_assisted": hf / ours})
    log(f"  speculative: oracle α={alpha} γ={gamma}: {out['speculative_ms_per_token']:.2f} ms/token "
        f"(τ={out['measured_tau']:.2f}); same pair ours {ours:.2f} vs HF assisted {hf:.2f} ms/token")
    return out


def bench_prompts(per_category: int) -> list[tuple[str, str]]:
    path = Path(__file__).parent / "prompts" / "default.jsonl"
    taken: dict[str, int] = {}
    out = []
    for line in path.read_text().splitlines():
        item = json.loads(line)
        if taken.get(item["category"], 0) < per_category:
            taken[item["category"]] = taken.get(item["category"], 0) + 1
            out.append((item["category"], item["prompt"]))
    return out


def end_to_end(target_spec: str, device, dtype, n=128, per_category=2, gamma=5, log=print, compile=False) -> dict:
    """A real target: HF generate / HF prompt lookup vs speculant none / ngram (fast path), same prompts."""
    lm = load_model(target_spec, device=device, dtype=dtype)
    model = lm.model
    prompts = bench_prompts(per_category)
    methods = _e2e_methods(lm, device, gamma, compile)
    ids = [Generator(lm, NoDrafter(), 1).encode(p) for _, p in prompts]
    run = functools.partial(_e2e_run, model, device, n, gamma)
    for name, gen in methods.items():  # warm-up (graph capture, allocator) on the first prompt
        run(name, gen, ids[0])
    records = []
    for (cat, _), x in zip(prompts, ids):
        ref = None
        for name, gen in methods.items():
            toks, stats, sec = run(name, gen, x)
            if name == "hf_generate":
                ref = toks
            records.append(_e2e_record(model, device, cat, name, x, ref, toks, stats, sec))
    summary = _e2e_summary(methods, records, log)
    return {"target": target_spec, "weights_bytes": weight_bytes(model), "max_new_tokens": n, "gamma": gamma,
            "summary": summary, "records": records}


def _e2e_methods(lm, device, gamma: int, compile: bool) -> dict:
    """The methods compared, by name: None for HF's own generate (plain or with prompt lookup)."""
    gpu_compile = compile and device.type == "cuda"
    methods = {
        "hf_generate": None,
        "hf_prompt_lookup": None,
        "speculant_none": Generator(lm, NoDrafter(), 1, path="fast", compile=gpu_compile),
        "speculant_ngram": Generator(lm, NgramDrafter(), gamma, path="fast", compile=gpu_compile),
    }
    if compile and device.type == "cpu":  # on CPU the compiled rows sit beside the eager ones
        methods["speculant_none_compiled"] = Generator(lm, NoDrafter(), 1, path="fast", compile=True)
        methods["speculant_ngram_compiled"] = Generator(lm, NgramDrafter(), gamma, path="fast", compile=True)
    return methods


def _e2e_run(model, device, n: int, gamma: int, name: str, gen, x: list[int]) -> tuple[list[int], dict, float]:
    """One method on one prompt: (tokens, stats, seconds)."""
    sync(device)
    t = time.perf_counter()
    if gen is None:
        kw = {"prompt_lookup_num_tokens": gamma} if name == "hf_prompt_lookup" else {}
        ids = torch.tensor([x], device=device)
        toks = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              **kw)[0, len(x):].tolist()
        stats = {}
    else:
        o = gen.generate_ids([x], max_new_tokens=n)[0]
        toks, stats = o.token_ids, o.stats
    sync(device)
    return toks, stats, time.perf_counter() - t


def _e2e_record(model, device, cat: str, name: str, x, ref, toks, stats: dict, sec: float) -> dict:
    k = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), None)
    gap = None
    if k is not None:  # the reference's logit gap between its token and ours: a near-tie?
        with torch.no_grad():
            logits = model(torch.tensor([x + ref[:k]], device=device)).logits[0, -1].float()
        gap = float(logits[ref[k]] - logits[toks[k]])
    return {"category": cat, "method": name, "tokens": len(toks), "seconds": sec,
            "tokens_per_second": len(toks) / sec, "identical_to_hf": toks == ref,
            "first_mismatch": k, "logit_gap_at_mismatch": gap,
            "acceptance_rate": stats.get("acceptance_rate"),
            "mean_accepted_tokens": stats.get("mean_accepted_tokens")}


def _e2e_summary(methods: dict, records: list[dict], log) -> dict:
    summary = {}
    for name in methods:
        rs = [r for r in records if r["method"] == name]
        toks, sec = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        gaps = [r["logit_gap_at_mismatch"] for r in rs if r["logit_gap_at_mismatch"] is not None]
        summary[name] = {"tokens_per_second": toks / sec, "ms_per_token": sec / toks * 1e3,
                         "identical": sum(r["identical_to_hf"] for r in rs), "prompts": len(rs),
                         "max_logit_gap_at_mismatch": max(gaps) if gaps else None}
        acc = [r["mean_accepted_tokens"] for r in rs if r["mean_accepted_tokens"] is not None]
        if acc:
            summary[name]["mean_tau"] = sum(acc) / len(acc)
    base = summary["hf_generate"]["tokens_per_second"]
    for name in methods:
        summary[name]["speedup_vs_hf_generate"] = summary[name]["tokens_per_second"] / base
        log(f"  e2e {name:18s} {summary[name]['tokens_per_second']:8.1f} tok/s  x{summary[name]['speedup_vs_hf_generate']:.2f}"
            f"  identical {summary[name]['identical']}/{summary[name]['prompts']}"
            f"  max gap at mismatch {summary[name]['max_logit_gap_at_mismatch']}")
    return summary


def kernel_table(target_spec: str, device, bandwidth: float, n=32, prompt_len=128, log=print) -> dict:
    """CPU: per dtype and matmul-kernel choice, plain decoding ms/token and one verify pass of 1-9
    tokens, beside HF generate in the same dtype and the bandwidth floor (issue: every CPU)."""
    rows = []
    for dtype in ("float32", "bfloat16"):
        model = load_model(target_spec, device=device, dtype=dtype).model
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
        floor = weight_bytes(model) / (bandwidth * 1e9) * 1e3
        hf = hf_ms_per_token(model, prompt, n, device)
        rows.append({"dtype": dtype, "method": "HF generate", "kernels": "HF (F.linear)", "plain_ms_per_token": hf,
                     "floor_ms_per_token": floor})
        log(f"  {dtype}: floor {floor:.1f} ms/token, HF generate {hf:.1f} ms/token")
        for choice in ("auto", "fp32-blocks", "aten"):
            if choice == "fp32-blocks" and not (dtype == "bfloat16" and cpu_kernels.onednn_packs(torch.bfloat16)):
                continue  # what auto already is on a CPU without oneDNN bf16, and no choice in float32
            backend = Backend(model, "fast", kernels=choice)
            plain = decode_ms_per_token(model, backend, prompt, n, device)
            verify = verify_costs(backend, prompt, device, range(1, 10), vocab)
            rows.append({"dtype": dtype, "method": "speculant plain", "choice": choice, "kernels": backend.fast.kernels,
                         "plain_ms_per_token": plain, "floor_ms_per_token": floor, "speedup_vs_hf": hf / plain,
                         "verify_ms_by_k": verify, "verify_8_over_1": verify[8] / verify[1]})
            log(f"  {dtype} {backend.fast.kernels}: plain {plain:.1f} ms/token ({hf / plain:.2f}x HF), verify "
                + " ".join(f"{k}:{v:.1f}" for k, v in verify.items()) + f" ms (8/1 = {verify[8] / verify[1]:.2f})")
        del model
    return {"target": target_spec, "cpu_capability": cpu_kernels.cpu_capability(), "prompt_tokens": prompt_len,
            "new_tokens": n, "rows": rows}


def kernel_table_markdown(table: dict) -> str:
    lines = ["| dtype | method | kernels | ms/token | vs HF | vs floor | verify 1 / 4 / 8 / 9 tokens (ms) | 8 / 1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table["rows"]:
        v = r.get("verify_ms_by_k")
        verify = " / ".join(f"{v[k]:.1f}" for k in (1, 4, 8, 9)) if v else ""
        lines.append(f"| {r['dtype']} | {r['method']} | {r['kernels']} | {r['plain_ms_per_token']:.1f} | "
                     f"{r.get('speedup_vs_hf', 1.0):.2f}x | {r['plain_ms_per_token'] / r['floor_ms_per_token']:.1f}x | "
                     f"{verify} | {r['verify_8_over_1']:.2f} |" if v else
                     f"| {r['dtype']} | {r['method']} | {r['kernels']} | {r['plain_ms_per_token']:.1f} | 1.00x | "
                     f"{r['plain_ms_per_token'] / r['floor_ms_per_token']:.1f}x | | |")
    return "\n".join(lines)


def plot_kernel_table(table: dict, out: Path) -> None:
    import matplotlib  # plots only: matplotlib is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = [r for r in table["rows"] if "verify_ms_by_k" in r]
    for r in rows:
        ks = sorted(int(k) for k in r["verify_ms_by_k"])
        axes[0].plot(ks, [r["verify_ms_by_k"][k] for k in ks], marker="o", label=f"{r['dtype']}: {r['kernels']}"[:60])
    axes[0].set_xlabel("tokens verified in one pass")
    axes[0].set_ylabel("ms per pass")
    axes[0].set_ylim(bottom=0)
    axes[0].set_title(f"Verify cost by width ({table['cpu_capability']})")
    axes[0].legend(fontsize=6)
    labels = [f"{r['dtype'][:4]} {r['method'].removeprefix('speculant ')}\n{r['kernels'][:22]}" for r in table["rows"]]
    axes[1].bar(range(len(labels)), [r["plain_ms_per_token"] for r in table["rows"]], color="tab:blue",
                label="plain decoding")
    axes[1].scatter(range(len(labels)), [r["floor_ms_per_token"] for r in table["rows"]], color="red", zorder=5,
                    label="bandwidth floor")
    axes[1].set_xticks(range(len(labels)), labels, fontsize=6, rotation=30, ha="right")
    axes[1].set_ylabel("ms per token")
    axes[1].set_title("Plain decoding")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "kernels.png", dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speculant.bench.costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default="llama-1b,llama-8b")
    ap.add_argument("--drafter-shape", default="llama-1b", help="draft model for the speculative rows")
    ap.add_argument("--target-shape", default="llama-8b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="bench-out/costs")
    ap.add_argument("--compile", action="store_true", help="torch.compile the fast path's decoder layer (on CPU: "
                    "compiled end-to-end rows beside the eager ones)")
    ap.add_argument("--e2e", default=None, help="a real target (e.g. default or a .gguf) for end-to-end rows")
    ap.add_argument("--e2e-per-category", type=int, default=2)
    ap.add_argument("--e2e-tokens", type=int, default=128)
    ap.add_argument("--kernels", default=None, metavar="TARGET",
                    help="CPU: a table per dtype and matmul-kernel choice for this target (e.g. default): plain "
                         "decoding, verify widths 1-9, HF generate, floor; writes kernels.json/.md/.png")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(device), "dtype": args.dtype}
    result["copy_bandwidth_GBps"] = bw = copy_bandwidth(device)
    print(f"copy bandwidth {bw:.0f} GB/s (read + write)", flush=True)
    rows, models = [], {}
    for shape in filter(None, args.shapes.split(",")):
        row, model, backend, prompt = shape_costs(shape, device, dtype, bw, n=args.tokens, compile=args.compile)
        rows.append(row)
        models[shape] = (model, backend, prompt)
    result["shapes"] = rows
    if args.target_shape in models and args.drafter_shape in models:
        target, t_backend, prompt = models[args.target_shape]
        result["speculative"] = speculative_costs(target, t_backend, models[args.drafter_shape][0], prompt, device,
                                                  n=args.tokens, compile=args.compile)
    if args.kernels:
        result["kernels"] = table = kernel_table(args.kernels, device, bw, n=args.tokens)
        (out / "kernels.md").write_text(kernel_table_markdown(table) + "\n")
        plot_kernel_table(table, out)
        print(kernel_table_markdown(table))
    if args.e2e:
        result["end_to_end"] = e2e = end_to_end(args.e2e, device, dtype, n=args.e2e_tokens,
                                                per_category=args.e2e_per_category,
                                                compile=args.compile)
        e2e["floor_ms_per_token"] = e2e["weights_bytes"] / (bw * 1e9) * 1e3
    (out / "costs.json").write_text(json.dumps(result, indent=2))
    plot_costs(result, out)
    print(json.dumps({k: v for k, v in result.items() if k != "shapes"}, indent=1))
    return 0


def plot_costs(result, out: Path) -> None:
    import matplotlib  # plots only: matplotlib is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not result["shapes"]:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for row in result["shapes"]:
        ks = sorted(int(k) for k in row["verify_ms_by_k"])
        axes[0].plot(ks, [row["verify_ms_by_k"][k] / row["verify_ms_by_k"][1] for k in ks], marker="o", label=row["shape"])
    axes[0].set_xlabel("tokens verified in one pass (k)")
    axes[0].set_ylabel("cost relative to k = 1")
    axes[0].set_title("Verification cost by width")
    axes[0].legend()
    labels, floor, ours, hf = [], [], [], []
    for row in result["shapes"]:
        labels.append(row["shape"])
        floor.append(row["floor_ms_per_token"])
        ours.append(row["ours_plain_ms_per_token"])
        hf.append(row["hf_plain_ms_per_token"])
    xs = range(len(labels))
    w = 0.27
    axes[1].bar([x - w for x in xs], floor, w, label="bandwidth floor")
    axes[1].bar(list(xs), ours, w, label="speculant plain (fast path)")
    axes[1].bar([x + w for x in xs], hf, w, label="HF generate")
    spec = result.get("speculative")
    if spec:
        i = labels.index(result.get("target_shape", labels[-1])) if "target_shape" in result else len(labels) - 1
        axes[1].scatter([i], [spec["speculative_ms_per_token"]], color="red", zorder=5,
                        label=f"speculative, oracle α={spec['oracle_alpha']}, γ={spec['gamma']}")
    axes[1].set_xticks(list(xs), labels)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("ms per token (log)")
    axes[1].set_title(result["machine"].get("gpu", result["machine"]["cpu"]))
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "costs.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())

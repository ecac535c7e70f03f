"""Plain decoding per token on the same GGUF: speculant's kernel modes (q8: int8 activations,
quantized: float32 activations) beside llama.cpp and OpenVINO GenAI (those installed), greedy, the
same prompt token ids and thread count, one process: a short chat prompt and a ~1.5k-token one.

For each runtime and prompt: the time to the first token (the prefill and the first token) and the
mean time of each later token, best of ``--rounds`` runs in a rotated order; and the floor of a
one-token step: the bytes a step streams (the quantized blocks, float32 for speculant's packed
layout; and per prompt, with the keys and values a step reads at the later tokens' mean context:
float16 in q8, float32 in quantized) over this CPU's measured read bandwidth (a large array summed,
best of 5). The bandwidth is also measured before each round and each runtime's ms a token set
against that round's floor (medians over the rounds in ``floor_ratio_by_round``): on a VM whose
speed drifts from one minute to the next, a ratio taken within a round. Saves JSON.

``--llama-cpp PATH``: import llama-cpp-python from PATH (a build of its own: e.g. AVX2 only, to
compare the AVX2 class on an AVX-512 machine with ``SPECULANT_CPU_ISA=avx2``). ``--base REV``: a
mode marked ``:base`` (``--modes q8,q8:base``) runs on the CPU kernels of git revision REV (a kernel
change against the build before it, in one process; a revision before q8's float16 cache, cd2fccd,
reads a float32 cache only: mark its mode ``:float32-cache`` too). ``q8:float32-cache``: q8 with a
float32 cache (the kernels take either). ``float32``: the dequantised model's float32 weights on the
kernel core; ``float32:onednn``: on oneDNN's packed copies, as before the core took float32;
``float32:bf16-values``: a copy whose every parameter is rounded to a bfloat16 value (a bf16
checkpoint loaded in float32: the core keeps bfloat16 copies), ``:float32-weights`` its float32 ones.

    python scripts/plain_per_token.py --out benchmarks/results/NAME
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import speculant
from ab_common import Kernels
from speculant.bench import peers
from speculant.bench.machine import machine_info
from speculant.bench.prompts import read_prompts
from speculant.drafters import make_drafter
from speculant.models import quantized
from speculant.models.fast import FastLlama, quantized_layer
from speculant.models.loading import LoadedModel, default_model_path, load_model

SHORT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def ours(mode: str, kernels: Kernels):
    """(a runner, the bytes of one cached key or value element, the bytes of weights a step streams or
    None) for a mode: DTYPE[:base][:float32-cache][:onednn][:bf16-values][:float32-weights]"""
    dtype, *options = mode.split(":")
    base = "base" in options
    kernels.use(base)  # the model binds its layers in the module it will run on
    target = load_model("default", device="cpu", dtype=dtype)
    if "bf16-values" in options:  # a bf16 checkpoint loaded in float32: a copy, every parameter a bfloat16 value
        model = copy.deepcopy(target.model)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
        target = LoadedModel(model, target.tokenizer, target.name)
    quantized.BF16_WEIGHTS = "float32-weights" not in options
    gen = speculant.Generator(target, make_drafter("none", target), kernels="onednn" if "onednn" in options else None)
    quantized.BF16_WEIGHTS = True
    fast = gen.backend.fast
    weight_bytes = kernel_bytes(fast) if fast.pass_set.layer_fn is quantized_layer else None
    if "float32-cache" in options:
        fast.cache_dtype = torch.float32

    def run(ids, n):
        kernels.use(base)
        return gen.generate_ids([ids], max_new_tokens=n)[0].token_ids

    return run, fast.cache_dtype.itemsize, weight_bytes


def peer(name: str):
    runner = peers.load(name, default_model_path(), 4096)
    return lambda ids, n: runner.generate(ids, n, set())  # no EOS: every runtime makes n tokens


def read_bandwidth_gbs() -> float:
    """GB/s of summing a 512 MB float32 array (best of 5): what a memory-bound step can stream."""
    a = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def step_bytes(mode: str) -> int:
    """Bytes of weights a one-token step reads in a kernel mode: every linear's packed blocks."""
    return kernel_bytes(FastLlama(load_model("default", device="cpu", dtype=mode).model))


def kernel_bytes(fast) -> int:
    """Bytes of the weights a pass on the kernels streams: every linear's kernel weight and the LM head's."""
    linears = [fast.pass_set.head.fn] + [lin for w in fast.pass_set.layers for lin in w["quantized"].values()]
    return sum(int(lin.args[0].numel() * lin.args[0].element_size()) for lin in linears)


def cache_bytes_per_key(config, element: int) -> int:
    """Bytes of keys and values (``element`` bytes each) one cached token holds over every layer: a
    step at context c reads c of them (the floor counts them too: at 1.5k tokens they outweigh the weights)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element


def prompts(tokenizer) -> dict[str, list[int]]:
    def chat(text):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    longest = max((p for p in read_prompts() if p.category in ("summarization", "rag")), key=lambda p: len(p.prompt))
    text = longest.prompt
    while len(chat(text)) < 1400:  # ~1.5k tokens: the bench's longest context prompt, repeated as needed
        text = text + "\n\n" + longest.prompt
    long = chat(text)
    return {"short": chat(SHORT), "long": long[-1500:] if len(long) > 1500 else long}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="q8,quantized")
    ap.add_argument("--llama-cpp", default=None, help="import llama-cpp-python from this folder first")
    ap.add_argument("--base", help="a git revision whose CPU kernels the modes marked :base run on")
    a = ap.parse_args()
    if a.llama_cpp:
        sys.path.insert(0, a.llama_cpp)
    torch.set_num_threads(2)
    modes = a.modes.split(",")
    if any("base" in m.split(":")[1:] for m in modes) and not a.base:
        ap.error(":base modes need --base REV")
    kernels = Kernels(a.base)
    fp32 = load_model("default", device="cpu", dtype="float32")
    tok = fp32.tokenizer
    built = {m: ours(m, kernels) for m in modes}
    runtimes = {f"speculant {m}": run for m, (run, _, _) in built.items()}
    per_key = {m: cache_bytes_per_key(fp32.model.config, element) for m, (_, element, _) in built.items()}
    runtimes |= {name: peer(name) for name in ("llama.cpp", "openvino") if name in peers.installed()}
    bandwidth = read_bandwidth_gbs()
    results = {"machine": machine_info(), "kernels_isa": quantized.kernels().isa(), "threads": 2, "base": a.base,
               "read_bandwidth_gb_s": round(bandwidth, 1), "prompts": {}}
    weights = {m: built[m][2] or step_bytes(m.split(":")[0]) for m in modes}
    results["floor_ms_per_token"] = {m: round(weights[m] / bandwidth / 1e6, 2) for m in modes}  # the weights alone
    for pname, ids in prompts(tok).items():
        best = {name: {"first_token_ms": float("inf"), "total_ms": float("inf")} for name in runtimes}
        made = {}
        for run in runtimes.values():  # warm-up
            run(ids, 4)
        names = list(runtimes)
        mean_context = len(ids) + a.tokens / 2
        by_round = {name: [] for name in runtimes}  # (ms a later token, this round's floor of its mode)
        for r in range(a.rounds):
            round_bandwidth = read_bandwidth_gbs()
            for name in names[r % len(names):] + names[: r % len(names)]:
                run = runtimes[name]
                t = time.perf_counter()
                run(ids, 1)
                first = time.perf_counter() - t
                t = time.perf_counter()
                made[name] = len(run(ids, a.tokens))
                total = time.perf_counter() - t
                best[name]["first_token_ms"] = min(best[name]["first_token_ms"], first * 1e3)
                best[name]["total_ms"] = min(best[name]["total_ms"], total * 1e3)
                mode = name.removeprefix("speculant ")
                if mode in weights:
                    floor_ms = (weights[mode] + per_key[mode] * mean_context) / round_bandwidth / 1e6
                    by_round[name].append(((total - first) * 1e3 / (made[name] - 1), floor_ms))
        rows = {}
        for name, b in best.items():
            per = (b["total_ms"] - b["first_token_ms"]) / (made[name] - 1)
            rows[name] = {"tokens": made[name], "first_token_ms": round(b["first_token_ms"], 1),
                          "ms_per_later_token": round(per, 2), "total_ms": round(b["total_ms"], 1)}
            print(f"{pname:5s} {name:24s} first token {b['first_token_ms']:7.1f} ms   then {per:6.2f} ms/token")
        # the floor of this prompt's later tokens: the weights and the cache at their mean context
        floor = {m: round((weights[m] + per_key[m] * mean_context) / bandwidth / 1e6, 2) for m in modes}
        print(f"{pname:5s} floor with the cache at {mean_context:.0f} tokens (ms/token): {floor}")
        ratios = {name: round(statistics.median(ms / f for ms, f in runs), 2) for name, runs in by_round.items() if runs}
        print(f"{pname:5s} ms a token over the floor, within each round (median of {a.rounds}): {ratios}")
        results["prompts"][pname] = {"prompt_tokens": len(ids), "runtimes": rows, "floor_ms_per_token": floor,
                                     "floor_ratio_by_round": ratios,
                                     "rounds": {name: [{"ms_per_later_token": round(ms, 2), "floor_ms": round(f, 2)}
                                                       for ms, f in runs] for name, runs in by_round.items() if runs}}
    print("floor of the weights alone (ms/token):", results["floor_ms_per_token"], f"at {bandwidth:.1f} GB/s")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plain_per_token.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

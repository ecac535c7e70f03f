"""A q8 one-token pass as one kernel call (``run_pass``: embeddings to logits) beside the same pass
as the calls it replaces (the embedding, the rotary rows, ``run_layers``, the final norm, the LM
head), alternated in one process after the short and the ~1.5k-token prompt of
``plain_per_token.py``: the best, first quartile and median of ``--rounds`` rounds of 10 passes
each, and whether both give the same logits. Then why it pays: the Python of those calls timed
alone in a loop, after a 100 MB array sum and after the decoder layers (a cold cache).

    python scripts/whole_pass_ab.py [--rounds 30] [--out F.json]
"""
import argparse
import json
import statistics
import time

import torch

import speculant
from plain_per_token import prompts
from speculant.bench.machine import machine_info
from speculant.models import invariant, quantized


def spread(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"best_us": round(ordered[0]), "p25_us": round(ordered[len(ordered) // 4]),
            "median_us": round(statistics.median(ordered))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(2)
    gen = speculant.load("default", drafter="none", dtype="q8")
    fast = gen.backend.fast
    results = {"machine": machine_info(), "kernels_isa": quantized.kernels().isa(), "threads": 2, "passes": {}}
    for name, ids in prompts(gen.tokenizer).items():
        P = len(ids)
        keys, values = fast.new_cache(1, P + 8)
        fast.prefill(torch.tensor([ids]), keys, values, last_only=True)
        bound = fast.pass_set.all_layers()
        assert bound.whole_passes, "the default target's LM head is of its GGUF's blocks"
        tok, pos = torch.tensor([[ids[-1]]]), torch.tensor([[P]])

        def run(whole: bool):
            bound.whole_passes = whole
            return fast.forward(tok, pos, pos, keys, values, True)

        same = torch.equal(run(True), run(False))
        times = {True: [], False: []}
        for r in range(a.rounds):
            for whole in (True, False) if r % 2 else (False, True):
                t = time.perf_counter()
                for _ in range(10):
                    run(whole)
                times[whole].append((time.perf_counter() - t) / 10 * 1e6)
        bound.whole_passes = True
        row = {"prompt_tokens": P, "same_logits": same, "one_call": spread(times[True]),
               "the_calls_it_replaces": spread(times[False])}
        results["passes"][name] = row
        print(name, P, "one call", row["one_call"], "its calls", row["the_calls_it_replaces"], "same:", same)

    # the replaced calls' Python alone, after a memory sweep, after the layers
    ids = prompts(gen.tokenizer)["short"]
    P = len(ids)
    keys, values = fast.new_cache(1, P + 8)
    fast.prefill(torch.tensor([ids]), keys, values, last_only=True)
    tok, pos = torch.tensor([[ids[-1]]]), torch.tensor([[P]])
    layers = fast.pass_set.all_layers()
    h = fast.embed(tok)
    cos, sin = fast.rotary(pos, P + 1)
    layout = invariant.key_layout(pos + 1, fast.dtype, None)

    def python_of_a_pass():
        hh = fast.embed(tok)
        fast.rotary(pos, P + 1)
        invariant.key_layout(pos + 1, fast.dtype, None)
        (torch.arange(1)[:, None].expand(1, 1), pos)
        int(pos.max())
        return fast.pass_set.final_norm(hh)

    big = torch.ones(25 * 1024 * 1024)
    before = {"alone": lambda: None, "after a 100 MB sum": big.sum,
              "after the decoder layers": lambda: layers(h, cos, sin, keys, values, pos, layout, fast.scaling)}
    cold = {k: [] for k in before}
    for _ in range(3):
        for label, first in before.items():
            total = 0.0
            for _ in range(200):
                first()
                t = time.perf_counter()
                python_of_a_pass()
                total += time.perf_counter() - t
            cold[label].append(total / 200 * 1e6)
    results["python_of_a_pass_us"] = {k: round(min(v), 1) for k, v in cold.items()}
    print("the Python of a pass's small calls (us, best of 3):", results["python_of_a_pass_us"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

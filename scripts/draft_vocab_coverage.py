"""Draft-vocabulary coverage of the bench's greedy answers at several sizes: tokens ranked by their count in
ShareGPT's assistant turns (a proxy for the self-distilled text the shipped head's vocabulary came from).
Reads bench_answers_4_128.pt from head_on_bench_answers.py (run from the same folder)."""
import collections, json
from pathlib import Path
import torch
from safetensors.torch import load_file
from speculant.bench.machine import machine_info
from speculant.models.loading import load_model
from speculant.trained.data import sharegpt_conversations
tok = load_model("default", device="cpu", dtype="float32").tokenizer
counts = collections.Counter()
n_conv = 3000
for i, conv in enumerate(sharegpt_conversations(n_conv)):
    for m in conv:
        if m["role"] == "assistant":
            counts.update(tok(m["content"][:4000], add_special_tokens=False)["input_ids"])
ranked = [t for t, _ in counts.most_common()]
print("distinct answer tokens in", n_conv, "conversations:", len(ranked), "total", sum(counts.values()))
seqs = torch.load("bench_answers_4_128.pt")  # written by head_on_bench_answers.py
shipped = load_file(str(Path(__file__).resolve().parents[1] / "speculant/data/drafters/eagle-smollm2-135m/model.safetensors"))["t2d"].bool()
sizes = [4096, 8192, 12288, 16384, 24576, 32768]
sets = {n: set(ranked[:n]) for n in sizes}
by = collections.defaultdict(lambda: collections.Counter())
for c, ids, lf in seqs:
    ans = ids[lf:].tolist()
    by[c]["n"] += len(ans)
    by[c]["shipped"] += sum(bool(shipped[t]) for t in ans)
    for n in sizes:
        by[c][n] += sum(t in sets[n] for t in ans)
print("category".ljust(20), "shipped8k", *[f"{n//1024}k".rjust(6) for n in sizes])
tot = collections.Counter()
for c, d in by.items():
    tot.update(d)
    print(c.ljust(20), f"{d['shipped']/d['n']:.3f}".rjust(9), *[f"{d[n]/d['n']:.3f}".rjust(6) for n in sizes])
print("all".ljust(20), f"{tot['shipped']/tot['n']:.3f}".rjust(9), *[f"{tot[n]/tot['n']:.3f}".rjust(6) for n in sizes])

import sys
json.dump({"machine": machine_info(), "what": "share of the bench answers' tokens (first 4 prompts a category, greedy, <= 128 tokens) inside a draft "
                   "vocabulary of the N tokens most frequent in ShareGPT's assistant turns (first %d conversations; a proxy "
                   "for the self-distilled text the shipped head's vocabulary came from), and inside the shipped head's own 8,192" % n_conv,
           "by_category": {c: {"answer_tokens": d["n"], "shipped_8192": round(d["shipped"] / d["n"], 3),
                               **{str(n): round(d[n] / d["n"], 3) for n in sizes}} for c, d in list(by.items()) + [("all", tot)]}},
          open(sys.argv[1] if len(sys.argv) > 1 else "draft-vocab-coverage.json", "w"), indent=1)

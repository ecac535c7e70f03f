"""Shipped EAGLE head on the bench's own greedy answers: per category chain τ, step-0 top-1/top-8 accuracy by
answer position, draft-vocab coverage. Run from the folder that is to hold its outputs:

    python scripts/head_on_bench_answers.py [PROMPTS_PER_CATEGORY [HEAD_DIR [OUT.json]]]

It saves the answers (bench_answers_4_128.pt) for draft_vocab_coverage.py and
sampled_vs_topk_drafts.py. Made benchmarks/results/cpu-AVX512BF16-2026-11-25-bench-answers/."""
import json, sys, time, random
from pathlib import Path
from collections import defaultdict
import torch
from safetensors.torch import load_file
from speculant.bench.machine import machine_info
from speculant.models.loading import load_model
from speculant.trained.eagle import EagleNet, EagleTrainer
from speculant.tools.train_batched import tapped_features
torch.set_grad_enabled(False)
N_PER = int(sys.argv[1]) if len(sys.argv) > 1 else 4
TOK = 128
head_dir = sys.argv[2] if len(sys.argv) > 2 else str(Path(__file__).resolve().parents[1] / "speculant/data/drafters/eagle-smollm2-135m")
cache = Path(f"bench_answers_{N_PER}_{TOK}.pt")  # the answers, for draft_vocab_coverage.py
target = load_model("default", device="cpu", dtype="float32")
model, tok = target.model, target.tokenizer
rows = [json.loads(l) for l in open(Path(__file__).resolve().parents[1] / "speculant/bench/prompts/default.jsonl")]
bycat = defaultdict(list)
for r in rows: bycat[r["category"]].append(r)
if cache.exists():
    seqs = torch.load(cache)
else:
    seqs = []
    for c, rs in bycat.items():
        for r in rs[:N_PER]:
            ids = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            x = torch.tensor([list(ids)])
            g = model.generate(x, max_new_tokens=TOK, do_sample=False, eos_token_id=sorted(target.eos_token_ids))[0, x.shape[1]:]
            ends = [j for j, t in enumerate(g.tolist()) if t in target.eos_token_ids]
            g = g[: ends[0] + 1] if ends else g
            seqs.append((c, torch.cat([x[0], g]), x.shape[1]))
        print("generated", c, flush=True)
    torch.save(seqs, cache)
cfg = json.loads((Path(head_dir) / "config.json").read_text())
net = EagleNet(cfg)
net.load_state_dict({k: v.float() for k, v in load_file(str(Path(head_dir) / "model.safetensors")).items()}, strict=False)
net.eval()
taps = cfg["eagle_aux_hidden_state_layer_ids"]
trainer = EagleTrainer(net, model.get_input_embeddings(), model.get_output_embeddings(), 3)
t2d = net.t2d
res = {}
buckets = [(0, 4), (4, 16), (16, 32), (32, 64), (64, 128)]
pos_hit = defaultdict(lambda: [0, 0, 0])
allcat = []
for c in bycat:
    feats = []
    cover = [0, 0]
    for cc, ids, lf in seqs:
        if cc != c: continue
        f = tapped_features(model, taps, [(ids, lf)], 4096, "cpu")[0]
        k = len(f.ids)
        feats.append(f)
        ans = ids[lf:]
        cover[0] += int(t2d[ans].sum()); cover[1] += len(ans)
        # step-0 predictions: row i predicts token i+2
        out = trainer._run(f, 1, True)[0]  # [n, Vd]
        top8 = net.target_ids(out.topk(8, -1).indices)
        labels = f.labels  # token i+1 at row i
        for i in range(max(lf - 1, 0), k - 1):
            want = ids[i + 2] if i + 2 < len(ids) else None
            if want is None: continue
            p = i + 2 - lf
            b = next(j for j, (a, z) in enumerate(buckets) if a <= p < z) if p < 128 else len(buckets) - 1
            pos_hit[b][0] += 1; pos_hit[b][1] += int(top8[i, 0] == want); pos_hit[b][2] += int((top8[i] == want).any())
    m = trainer.evaluate(feats, random.Random(1))
    res[c] = dict(chain_tau=round(m["tau"], 2), alpha=m["alpha_by_slot"], draft_vocab_coverage=round(cover[0] / cover[1], 3))
    allcat += feats
    print(c, res[c], flush=True)
m = trainer.evaluate(allcat, random.Random(1))
print("all", round(m["tau"], 3), m["alpha_by_slot"])
res["all"] = dict(chain_tau=round(m["tau"], 3), alpha=m["alpha_by_slot"])
out = {"what": "the shipped EAGLE head on the target's own greedy answers (float32, HF generate, <= 128 tokens) to the "
               "first %d bench prompts of each category: chain of 6 fed its own guesses (as speculant train's held-out "
               "evaluation), draft-vocabulary coverage of the answer tokens, and the head's first-step top-1 / top-8 "
               "accuracy by position in the answer" % N_PER, "by_category": res, "first_step_by_answer_position": {}}
for b, (a, z) in enumerate(buckets):
    n, t1, t8 = pos_hit[b]
    print(f"answer tokens {a}-{z}: n {n}  top1 {t1/max(n,1):.3f}  top8 {t8/max(n,1):.3f}")
    out["first_step_by_answer_position"][f"{a}-{z}"] = {"rows": n, "top1": round(t1 / max(n, 1), 3), "top8": round(t8 / max(n, 1), 3)}
out["machine"] = machine_info()
json.dump(out, open(sys.argv[3] if len(sys.argv) > 3 else "head-on-bench-answers.json", "w"), indent=1)

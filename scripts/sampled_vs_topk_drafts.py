"""T=1: expected first-step acceptance of (a) one sampled draft from the head's q: sum min(p, q);
(b) deterministic top-k nodes of q: sum of p over them; on the bench answers (teacher-forced).
Reads bench_answers_4_128.pt from head_on_bench_answers.py (run from the same folder)."""
import json, sys, random
from pathlib import Path
from collections import defaultdict
import torch
from safetensors.torch import load_file
from speculant.bench.machine import machine_info
from speculant.models.loading import load_model
from speculant.trained.eagle import EagleNet, EagleTrainer
from speculant.tools.train_batched import tapped_features
torch.set_grad_enabled(False)
head_dir = str(Path(__file__).resolve().parents[1] / "speculant/data/drafters/eagle-smollm2-135m")
seqs = torch.load("bench_answers_4_128.pt")  # written by head_on_bench_answers.py
target = load_model("default", device="cpu", dtype="float32"); model = target.model
cfg = json.loads((Path(head_dir) / "config.json").read_text())
net = EagleNet(cfg); net.load_state_dict({k: v.float() for k, v in load_file(str(Path(head_dir) / "model.safetensors")).items()}, strict=False); net.eval()
tr = EagleTrainer(net, model.get_input_embeddings(), model.get_output_embeddings(), 3)
rows_t = net.target_ids(torch.arange(8192))
W = model.get_output_embeddings().weight
acc = defaultdict(float); n = 0
for c, ids, lf in seqs:
    f = tapped_features(model, cfg["eagle_aux_hidden_state_layer_ids"], [(ids, lf)], 4096, "cpu")[0]; k = len(f.ids)
    ql = tr._run(f, 1, True)[0]  # [k-1, 8192] head logits, row i predicts token i+2
    for T in (1.0, 0.7):
        q = torch.zeros(ql.shape[0], W.shape[0]); q[:, rows_t] = (ql / T).softmax(-1)
        p = (f.final[1:k] @ W.T / T).softmax(-1)  # target at position i+1 predicts token i+2
        sl = slice(max(lf - 1, 0), k - 1)
        qq, pp = q[sl], p[sl]
        acc[(T, "sampled: sum min(p,q)")] += float(torch.minimum(pp, qq).sum(-1).sum())
        top = qq.topk(8, -1).indices
        pt = pp.gather(1, top)
        for kk in (1, 2, 3, 4, 8):
            acc[(T, f"top-{kk} of q: sum p")] += float(pt[:, :kk].sum(-1).sum())
        acc[(T, "rows")] += qq.shape[0]
for T in (1.0, 0.7):
    print(f"T={T}: " + ", ".join(f"{k[1]} {v / acc[(T, 'rows')]:.3f}" for k, v in acc.items() if k[0] == T and k[1] != "rows"))
json.dump({"machine": machine_info(), **{str(T): {k[1]: round(v / acc[(T, "rows")], 3) for k, v in acc.items()
                                             if k[0] == T and k[1] != "rows"} for T in (1.0, 0.7)}}, open("sampled-vs-topk-drafts.json", "w"), indent=1)

"""A verify pass's cost in situ: the target's pass kernel (run_pass) timed by width during greedy q8
decoding of 8 bench prompts (2 each of chat, code, QA, summaries; 48 tokens, 3 rounds alternated),
with no drafter, with a drafter that costs nothing (2 junk drafts a pass, so every pass verifies 3
rows), the same plus a copy of MB megabytes before each pass (traffic like a head's), and the EAGLE
head at gamma 2 with its weights at 8 and at 4 bits.

    python verify_in_situ.py [MB]"""
import time, collections, statistics, sys
import torch
import speculant
from speculant.models import fast, quantized
from speculant.drafters import eagle, make_drafter
from speculant.drafters.none import NoDrafter
from speculant.drafters.base import Proposal
from speculant.models.loading import load_model
from speculant.bench.prompts import read_prompts
torch.set_num_threads(2)
MB = int(sys.argv[1]) if len(sys.argv) > 1 else 10
buf = torch.ones(MB * 2**20 // 4); dst = torch.empty_like(buf)
class Junk(NoDrafter):
    name = "junk"
    drafts_nothing = False
    copy = False
    def propose(self, gamma):
        if self.copy:
            dst.copy_(buf)
        t = torch.tensor([[13, 14][:gamma]] * self.rows)
        return Proposal(t, torch.full((self.rows,), t.shape[1]))
class JunkCopy(Junk):
    copy = True
rec = collections.defaultdict(list)
orig = fast.BoundLayers.run_pass
cur = ["?"]
def timed(self, tokens, *a):
    t = time.perf_counter()
    out = orig(self, tokens, *a)
    rec[(cur[0], tokens.shape[1])].append(time.perf_counter() - t)
    return out
fast.BoundLayers.run_pass = timed
chain = eagle.KernelLayers.chain


def timed_chain(self, *a, **k):
    t = time.perf_counter()
    out = chain(self, *a, **k)
    rec[(cur[0], "head chain")].append(time.perf_counter() - t)
    return out


eagle.KernelLayers.chain = timed_chain
target = load_model("default", device="cpu", dtype="q8")
prompts = read_prompts()
cats = ["multi_turn_chat", "code", "question_answering", "summarization"]
ps = [p for c in cats for p in [q for q in prompts if q.category == c][:2]]
gens = {"none": speculant.Generator(target, make_drafter("none", target)),
        "junk": speculant.Generator(target, Junk(), gamma=2),
        f"junk+copy{MB}": speculant.Generator(target, JunkCopy(), gamma=2),
}
for bits in (8, 4):
    quantized.DRAFT_BITS = bits
    gens[f"eagle@2/{bits}-bit"] = speculant.Generator(target, make_drafter("eagle", target), gamma=2)
wall = collections.defaultdict(float)
for rep in range(3):
    for name, gen in (gens.items() if rep % 2 == 0 else reversed(list(gens.items()))):
        cur[0] = name
        for p in ps:
            t = time.perf_counter()
            out = gen.generate(p.prompt, max_new_tokens=48)
            wall[name] += time.perf_counter() - t
for k in sorted(rec, key=str):
    v = rec[k]
    if len(v) > 5:
        print(k, len(v), "median ms", round(1000*statistics.median(v), 3), "p25", round(1000*sorted(v)[len(v)//4], 3))
for name in gens:
    print(name, "wall", round(wall[name], 3), "s; plain's wall / this", round(wall["none"] / wall[name], 3))

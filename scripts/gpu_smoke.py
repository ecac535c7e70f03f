"""GPU smoke: the fast path with CUDA graphs gives HF generate's greedy tokens (tiny fp32 models)."""
import sys
from pathlib import Path

# the test suite's own fixtures (tiny random Llamas, a noisy copy as draft model, HF's greedy text as
# the reference): this is the suite's greedy identity check run on a GPU, and these are test
# helpers, not part of speculant's API, so they stay in tests/helpers.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import hf_greedy, mismatch_report, perturbed, tiny_llama  # noqa: E402

import speculant  # noqa: E402
from speculant.drafters import ModelDrafter  # noqa: E402

bad = 0
for seed in range(3):
    t = tiny_llama(seed).cuda()
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], list(range(1, 30))]
    refs = [hf_greedy(t, p, 40) for p in prompts]
    for kind in ["none", "ngram", "model"]:
        d = ModelDrafter(perturbed(t, 0.3, seed=3)) if kind == "model" else kind
        for batch in (1, 3):
            ps = prompts if batch == 3 else prompts[:1]
            outs = speculant.generate(t, ps, drafter=d, gamma=4, max_new_tokens=40, path="fast")
            for p, r, o in zip(ps, refs, outs):
                if o.token_ids != r:
                    bad += 1
                    print("MISMATCH", seed, kind, batch, mismatch_report(t, p, r, o.token_ids))
print("gpu smoke mismatches:", bad)

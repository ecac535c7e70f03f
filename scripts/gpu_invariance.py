"""Width invariance on a GPU: which kernels this device's checks choose, whether a verify block, a
token tree and a batch give one-token steps' bits (``FastLlama.proves_invariance``), and greedy text
with every drafter, γ and batch equal to plain decoding in bfloat16 and float32, fast path (CUDA
graphs) and general path. Random weights: SmolLM2-135M's shapes and tiny Llamas (no downloads).

    python scripts/gpu_invariance.py --out results.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# the test suite's tiny random Llamas and noisy draft copies (tests/helpers.py): fixtures of the
# suite this script repeats on a GPU, not part of speculant's API
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import perturbed, tiny_llama  # noqa: E402

import speculant  # noqa: E402
from speculant.bench.machine import machine_info  # noqa: E402
from speculant.drafters import ModelDrafter  # noqa: E402
from speculant.models.fast import FastLlama  # noqa: E402

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope_theta=100000.0)


def smol(dtype, device):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOL)).to(device=device, dtype=dtype).eval()


def prompts(vocab: int, n: int = 3):
    g = torch.Generator().manual_seed(107)
    out = [torch.randint(1, vocab, (3 + 9 * i,), generator=g).tolist() for i in range(n)]
    out[0] = out[1][:5] * 5  # a repetitive prompt: lookup drafts get accepted
    return out


def end_to_end(target, drafters, max_new: int, log) -> dict:
    """Greedy text of every drafter x γ x batch against plain decoding of each prompt alone."""
    ps = prompts(target.config.vocab_size)
    result = {}
    for path in ("fast", "general"):
        alone = [speculant.generate(target, [p], drafter="none", max_new_tokens=max_new, path=path)[0].token_ids
                 for p in ps]
        for name, make in drafters.items():
            for gamma in (1, 4, "auto"):
                for batch in (1, len(ps)):
                    rows = ps[:batch]
                    outs = speculant.generate(target, rows, drafter=make(), gamma=gamma, max_new_tokens=max_new,
                                              path=path)
                    same = sum(o.token_ids == a for o, a in zip(outs, alone))
                    key = f"{path} {name} gamma={gamma} batch={batch}"
                    result[key] = {"same": same, "of": batch,
                                   "accepted": sum(o.stats["accepted_draft_tokens"] for o in outs),
                                   "exact": outs[0].stats.get("exact")}
                    log(f"{key}: {same}/{batch} equal plain, accepted {result[key]['accepted']}")
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-invariance.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny models only")
    a = ap.parse_args()
    dev = torch.device(a.device)
    res = {"machine": machine_info(dev)}

    def log(msg):
        print(msg, flush=True)

    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        try:
            run_dtype(a, dev, dtype, name, res, log)
        except Exception as e:  # keep what the other parts found
            import traceback

            res[f"{name} error"] = traceback.format_exc()[-2000:]
            log(res[f"{name} error"])
        Path(a.out).write_text(json.dumps(res, indent=1))
    cases = [v for k, v in res.items() if k.endswith("tiny") or k.endswith("ngram")]
    bad = sum(c["of"] - c["same"] for case in cases for c in case.values())
    res["outputs differing from plain decoding"] = bad
    Path(a.out).write_text(json.dumps(res, indent=1))
    log(f"outputs differing from plain decoding: {bad}; written {a.out}")


def run_dtype(a, dev, dtype, name, res, log):
    t0 = time.time()
    model = smol(dtype, dev) if not a.quick else tiny_llama(0, layers=2).to(device=dev, dtype=dtype)
    fast = FastLlama(model)
    res[f"{name} checks seconds"] = round(time.time() - t0, 2)
    res[f"{name} kernels"] = fast.invariance
    t0 = time.time()
    res[f"{name} proof"] = fast.proves_invariance()
    res[f"{name} proof seconds"] = round(time.time() - t0, 2)
    log(f"{name}: {fast.invariance}; proof {res[f'{name} proof']}")
    if not a.quick:  # plain decoding speed of the SmolLM2 shape, CUDA graphs
        ps = prompts(model.config.vocab_size)
        speculant.generate(model, [ps[1]], drafter="none", max_new_tokens=16)
        t0 = time.time()
        o = speculant.generate(model, [ps[1]], drafter="none", max_new_tokens=128)[0]
        res[f"{name} smol plain ms/token"] = round((time.time() - t0) / len(o.token_ids) * 1e3, 3)
        res[f"{name} smol exact"] = o.stats.get("exact")
        res[f"{name} smol ngram"] = end_to_end(model, {"ngram": lambda: "ngram", "ngram:tree": lambda: "ngram:tree"},
                                               32, log)
        del model, fast
    tiny = tiny_llama(7, layers=2).to(device=dev, dtype=dtype)
    drafters = {"ngram": lambda: "ngram", "ngram:tree": lambda: "ngram:tree", "suffix": lambda: "suffix",
                "model": lambda: ModelDrafter(perturbed(tiny, 0.3, seed=14))}
    res[f"{name} tiny"] = end_to_end(tiny, drafters, 40, log)


if __name__ == "__main__":
    main()

"""Could OpenVINO run the target's forward for our engine? (issue 31, item 6)

The engine needs, of a backend: logits for a block of positions in one pass, a cache it can roll
back, and width invariance (a row's logits the same bits whatever block it is verified in), without
which speculative text parts from plain decoding. This converts the default target's own Q4_1 GGUF
to OpenVINO's model (OpenVINO GenAI's own GGUF reader, ``enable_save_ov_model``), runs its CPU
plugin on blocks of 1-16 tokens after a context, and compares each row with the same tokens decoded
one at a time (bits, largest difference, argmax); and times the passes beside our quantized
forward, in one process, best of ``--rounds``. Needs ``openvino-genai`` (not a dependency).

    python scripts/openvino_forward.py --out benchmarks/results/NAME
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from speculant.bench.machine import machine_info
from speculant.models.fast import FastLlama
from speculant.models.loading import default_model_path, load_model

WIDTHS = (1, 2, 4, 8, 16)
CONTEXT = 45
CONFIGS = {  # OpenVINO's CPU plugin: its default (int8 activations for int4 weights), and float32 throughout
    "openvino default": {},
    "openvino f32, no dynamic quantization": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
}


def convert(gguf: Path, folder: Path) -> Path:
    import openvino_genai

    shutil.copy(gguf, folder / gguf.name)
    openvino_genai.LLMPipeline(str(folder / gguf.name), "CPU", enable_save_ov_model=True)
    return folder / "openvino_model.xml"


def openvino_runs(xml: Path, config: dict, contexts: list, block: np.ndarray, rounds: int) -> dict:
    import openvino as ov

    compiled = ov.Core().compile_model(str(xml), "CPU", {"NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": "2", **config})
    req = compiled.create_infer_request()

    def run(tokens, start):
        n = len(tokens)
        req.infer({"input_ids": np.array([tokens], dtype=np.int64),
                   "attention_mask": np.ones((1, start + n), dtype=np.int64),
                   "position_ids": np.arange(start, start + n, dtype=np.int64)[None],
                   "beam_idx": np.zeros(1, dtype=np.int32)})
        return req.get_tensor("logits").data.copy()[0]

    def fresh(ctx):
        req.reset_state()
        run(ctx, 0)

    out = {w: {"rows_same_bits": True, "max_abs_diff": 0.0, "argmax_same": True} for w in WIDTHS}
    for ctx in contexts:
        fresh(ctx)
        alone = np.stack([run(block[i : i + 1], CONTEXT + i)[0] for i in range(max(WIDTHS))])
        for w in WIDTHS:
            fresh(ctx)
            got = run(block[:w], CONTEXT)
            o = out[w]
            o["rows_same_bits"] &= bool(np.array_equal(got, alone[:w]))
            o["max_abs_diff"] = max(o["max_abs_diff"], float(np.abs(got - alone[:w]).max()))
            o["argmax_same"] &= bool((got.argmax(-1) == alone[:w].argmax(-1)).all())
    for w in WIDTHS:
        best = float("inf")
        for _ in range(rounds):
            fresh(contexts[0])
            t = time.perf_counter()
            run(block[:w], CONTEXT)
            best = min(best, time.perf_counter() - t)
        out[w]["ms"] = round(best * 1e3, 2)
    # roll the cache back by truncating the states (copies): then a row decoded there
    fresh(contexts[0])
    run(block[:4], CONTEXT)
    t = time.perf_counter()
    for s in req.query_state():
        s.state = ov.Tensor(np.ascontiguousarray(s.state.data[:, :, : CONTEXT + 2]))
    rollback_ms = (time.perf_counter() - t) * 1e3
    after = run(block[2:3], CONTEXT + 2)[0]
    fresh(contexts[0])
    alone = [run(block[i : i + 1], CONTEXT + i)[0] for i in range(3)][2]
    return {"passes": out, "rollback_ms": round(rollback_ms, 2),
            "after_rollback_same_bits": bool(np.array_equal(after, alone))}


@torch.inference_mode()
def ours(contexts: list, block: np.ndarray, rounds: int) -> dict:
    fast = FastLlama(load_model("default", device="cpu", dtype="quantized").model)

    def run(ctx, w, one_by_one=False):
        keys, values = fast.new_cache(1, 256)
        fast.prefill(torch.tensor([ctx]), keys, values)
        if one_by_one:
            return torch.cat([run_block(block[i : i + 1], CONTEXT + i, keys, values) for i in range(w)])
        return run_block(block[:w], CONTEXT, keys, values)

    def run_block(tokens, start, keys, values):
        at = torch.arange(start, start + len(tokens))[None]
        return fast.forward(torch.tensor([tokens]), at, at, keys, values)[0]

    out = {w: {"rows_same_bits": True, "max_abs_diff": 0.0, "argmax_same": True} for w in WIDTHS}
    for ctx in contexts:
        alone = run(ctx, max(WIDTHS), one_by_one=True)
        for w in WIDTHS:
            got, o = run(ctx, w), out[w]
            o["rows_same_bits"] &= torch.equal(got, alone[:w])
            o["max_abs_diff"] = max(o["max_abs_diff"], float((got - alone[:w]).abs().max()))
            o["argmax_same"] &= bool((got.argmax(-1) == alone[:w].argmax(-1)).all())
    for w in WIDTHS:
        keys, values = fast.new_cache(1, 256)
        fast.prefill(torch.tensor([contexts[0]]), keys, values)
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            run_block(block[:w], CONTEXT, keys, values)
            best = min(best, time.perf_counter() - t)
        out[w]["ms"] = round(best * 1e3, 2)
    return {"kernels": fast.kernels, "passes": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    contexts = [rng.integers(100, 20000, CONTEXT).tolist() for _ in range(3)]
    block = rng.integers(100, 20000, max(WIDTHS))
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        xml = convert(default_model_path(), Path(tmp))
        results = {name: openvino_runs(xml, cfg, contexts, block, a.rounds) for name, cfg in CONFIGS.items()}
    results["speculant quantized"] = ours(contexts, block, a.rounds)
    results["threads"] = 2
    results["machine"] = machine_info()
    for name, r in results.items():
        if isinstance(r, dict):
            print(f"{name:40s} " + "  ".join(f"{w}: {p['ms']:.1f} ms{'' if p['rows_same_bits'] else ' (bits differ)'}"
                                             for w, p in r["passes"].items()))
    (out / "openvino_forward.json").write_text(json.dumps(results, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        ms = [r["passes"][w]["ms"] for w in WIDTHS]
        line, = ax.plot(WIDTHS, ms, marker="o", label=name)
        bad = [w for w in WIDTHS if not r["passes"][w]["rows_same_bits"]]
        ax.scatter(bad, [r["passes"][w]["ms"] for w in bad], s=120, facecolors="none", edgecolors=line.get_color())
    ax.set_xlabel("tokens in the pass (verify width)")
    ax.set_ylabel("ms per pass")
    ax.set_title("default target's Q4_1 GGUF: one pass (circled: rows' bits depend on the width)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "openvino_forward.png", dpi=120)


if __name__ == "__main__":
    main()

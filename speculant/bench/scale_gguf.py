"""A random-weight GGUF with a 7B model's shapes, for the scale test: speculant's load, memory and
cost per token on a file of a real 7B's size, side by side with llama.cpp on the same file.

Random weights make acceptance meaningless, but a token costs what it would: every weight streams
once a token, in the block types llama.cpp's Q4_K_M mix gives such a model (Q4_K, with Q6_K for the
output, and for v and down in the first and last eighths and every third layer between), written
with the gguf package. The tokenizer (and its chat template) is copied from a GGUF of the same
family, so the file loads as any download would::

    python -m speculant.bench.scale_gguf --shape qwen2.5-7b --tokenizer-from qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --out qwen2.5-7b-shaped-q4_k_m.gguf
    python -m speculant.bench.scale_gguf --measure qwen2.5-7b-shaped-q4_k_m.gguf --peers

``--measure``: load time, peak memory and ms per token of plain decoding (a short and a ~1.5k-token
prompt), with llama.cpp's on the same file and the bandwidth floor (the file's bytes at the
machine's measured read bandwidth), as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

# (architecture, hidden, layers, heads, kv heads, feed-forward, vocab, rope base, rms eps)
SHAPES = {
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 18944, 151936, 1_000_000.0, 1e-6),
    "llama-3-8b": ("llama", 4096, 32, 32, 8, 14336, 128256, 500_000.0, 1e-5),
}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M: v and down in Q6_K in the first and last eighths and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def write(shape: str, tokenizer_from: Path, out: Path, seed: int = 0) -> Path:
    import gguf
    from gguf.constants import GGMLQuantizationType as T

    from ..models.quantized import random_gguf_blocks

    arch, hidden, layers, heads, kv_heads, inner, vocab, rope, eps = SHAPES[shape]
    source = gguf.GGUFReader(str(tokenizer_from))
    tokens = [bytes(source.fields["tokenizer.ggml.tokens"].parts[i]) for i in source.fields["tokenizer.ggml.tokens"].data]
    if len(tokens) < vocab:
        raise SystemExit(f"{tokenizer_from} has {len(tokens)} tokens, fewer than {shape}'s {vocab}")
    vocab = len(tokens)  # the source's own (Qwen2.5-Coder's 151,936 for qwen2.5-7b's 152,064)
    g = torch.Generator().manual_seed(seed)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"random {shape}-shaped")
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inner)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope)
    w.add_layer_norm_rms_eps(eps)
    w.add_file_type(15)  # MOSTLY_Q4_K_M
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            values = [field.parts[i] for i in field.data]
            if field.types[1] == gguf.GGUFValueType.STRING:
                w.add_array(key, [bytes(v) for v in values])
            else:
                w.add_array(key, [v.tolist()[0] for v in values])
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(key, field.parts[field.data[0]].tolist()[0], kind)

    def blocks(name: str, kind: str, rows: int, cols: int) -> None:
        # scales below 2^-12 (weights of a few hundredths) and Q6_K's sub-scales 1..31, as tests/helpers' tiny files
        data = random_gguf_blocks(kind, rows, cols, g, scale_bits=0x0C00)
        if kind == "Q6_K":
            b = data.reshape(-1, 210)
            b[:, 192:208] = torch.randint(1, 32, (len(b), 16), generator=g, dtype=torch.uint8).numpy()
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=T[kind])

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    head_dim = hidden // heads
    blocks("token_embd.weight", "Q4_K", vocab, hidden)
    for i in range(layers):
        more = "Q6_K" if _more_bits(i, layers) else "Q4_K"
        ones(f"blk.{i}.attn_norm.weight", hidden)
        ones(f"blk.{i}.ffn_norm.weight", hidden)
        blocks(f"blk.{i}.attn_q.weight", "Q4_K", heads * head_dim, hidden)
        blocks(f"blk.{i}.attn_k.weight", "Q4_K", kv_heads * head_dim, hidden)
        blocks(f"blk.{i}.attn_v.weight", more, kv_heads * head_dim, hidden)
        if arch == "qwen2":
            for part, n in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
                w.add_tensor(f"blk.{i}.{part}.bias", np.zeros(n, dtype=np.float32))
        blocks(f"blk.{i}.attn_output.weight", "Q4_K", hidden, heads * head_dim)
        blocks(f"blk.{i}.ffn_gate.weight", "Q4_K", inner, hidden)
        blocks(f"blk.{i}.ffn_up.weight", "Q4_K", inner, hidden)
        blocks(f"blk.{i}.ffn_down.weight", more, hidden, inner)
    ones("output_norm.weight", hidden)
    blocks("output.weight", "Q6_K", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


def read_bandwidth(gb: float = 1.0) -> float:
    """The machine's read bandwidth (GB/s): the best of three sums over ``gb`` GB of float32."""
    x = torch.ones(int(gb * 1e9) // 4)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def measure(path: Path, peers: bool, tokens: int = 48) -> dict:
    """Load (seconds, peak resident memory) and plain decoding's ms per token after a short and a
    ~1.5k-token prompt, speculant's and (``peers``) llama.cpp's on the same file, and the floor."""
    import resource

    import psutil

    from ..models import loading
    from ..tools.loader import load

    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    gen = load(str(path), drafter="none", dtype="q8", device="cpu")
    out: dict = {"file": str(path), "file_gb": path.stat().st_size / 1e9, "load_s": time.perf_counter() - t0,
                 "rss_gb_after_load": psutil.Process().memory_info().rss / 1e9,
                 "rss_gb_model": (psutil.Process().memory_info().rss - before) / 1e9,
                 "cpu_kernels": gen.backend.info().get("cpu_kernels")}
    vocab = gen.target.vocab_size
    rng = torch.Generator().manual_seed(0)
    prompts = {"short": torch.randint(1000, min(vocab, 30000), (46,), generator=rng).tolist(),
               "long": torch.randint(1000, min(vocab, 30000), (1495,), generator=rng).tolist()}
    for name, ids in prompts.items():
        gen.generate_ids([ids], max_new_tokens=4)  # warm-up
        o = gen.generate_ids([ids], max_new_tokens=tokens)[0]
        s = o.stats
        decode = s["seconds"] - s["first_token_seconds"]
        out[f"speculant_ms_per_token_{name}"] = 1e3 * decode / max(1, s["new_tokens"] - 1)
        out[f"speculant_first_token_s_{name}"] = s["first_token_seconds"]
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    del gen
    loading._LOADED.clear()
    if peers:
        from .peers import LlamaCpp

        llm = LlamaCpp(path, 2048, lookup=False)
        for name, ids in prompts.items():
            llm.generate(ids, 4, set())
            t = time.perf_counter()
            llm.llm.reset()
            first = None
            n = 0
            for _ in llm.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                n += 1
                if first is None:
                    first = time.perf_counter() - t
                if n >= tokens:
                    break
            out[f"llama.cpp_ms_per_token_{name}"] = 1e3 * (time.perf_counter() - t - first) / max(1, n - 1)
            out[f"llama.cpp_first_token_s_{name}"] = first
    bandwidth = read_bandwidth()
    out["read_bandwidth_gb_s"] = bandwidth
    out["floor_ms_per_token"] = 1e3 * out["file_gb"] / bandwidth
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speculant.bench.scale_gguf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--tokenizer-from", type=Path, help="a GGUF of the same family whose tokenizer the file gets")
    ap.add_argument("--out", type=Path, help="the GGUF to write")
    ap.add_argument("--measure", type=Path, help="a GGUF to measure (written by this tool, or any)")
    ap.add_argument("--peers", action="store_true", help="llama.cpp (llama-cpp-python) on the same file too")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    if args.out:
        if not args.tokenizer_from:
            ap.error("--out needs --tokenizer-from")
        t = time.perf_counter()
        write(args.shape, args.tokenizer_from, args.out)
        print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    if args.measure:
        print(json.dumps(measure(args.measure, args.peers, args.tokens), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

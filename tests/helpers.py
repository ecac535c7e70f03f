"""Tiny random-weight models and comparison helpers for the tests (no downloads)."""
from __future__ import annotations

import json

import httpx
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, vocab: int = 96, layers: int = 2, hidden: int = 64, context: int = 512,
               eos: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos if eos is not None else 0
    return model


def perturbed(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """A copy with noisy weights: a drafter that agrees with the target often, not always."""
    import copy

    torch.manual_seed(seed)
    d = copy.deepcopy(model)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * noise * p.std())
    return d


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def greedy_texts(model, n: int, answer_tokens: int, seed: int = 2) -> list[tuple[torch.Tensor, int]]:
    """``n`` texts for training files: a random prompt of 4-6 ids and the model's greedy answer, as
    (uint16 ids, prompt length) pairs (tools/texts.py's format)."""
    g = torch.Generator().manual_seed(seed)
    texts = []
    for i in range(n):
        prompt = torch.randint(2, 96, (4 + i % 3,), generator=g).tolist()
        ids = torch.tensor(prompt + hf_greedy(model, prompt, answer_tokens), dtype=torch.int32).to(torch.uint16)
        texts.append((ids, len(prompt)))
    return texts


def mismatch_report(model, prompt: list[int], ref: list[int], got: list[int]) -> str:
    """Where two greedy outputs diverge, and the target's logit gap there (a float near-tie?)."""
    k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    if k >= min(len(ref), len(got)):
        return f"lengths differ: reference {len(ref)} tokens, ours {len(got)}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:k]])).logits[0, -1].float()
    gap = float(logits[ref[k]] - logits[got[k]])
    return (f"first divergence at new token {k}: reference {ref[k]}, ours {got[k]}; "
            f"reference logit gap {gap:.3g} (a near-tie if ~1e-5 or less)")


def assert_same_or_bf16_near_tie(model, prompt: list[int], ref: list[int], got: list[int], steps: int = 4):
    """Two valid bf16 computations of a model (a verify block of several tokens vs one-token steps,
    packed vs plain matmuls) round differently, so greedy texts may part at a near-tie: allowed only
    where the reference's top two logits lie within ``steps`` bf16 steps (2^-7 of the logit each);
    a wrong computation differs by whole units. The report names the gap either way."""
    k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if k is None:
        assert len(ref) == len(got), mismatch_report(model, prompt, ref, got)
        return
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:k]])).logits[0, -1].float()
    top = float(logits[ref[k]])
    bf16_step = 2.0 ** (torch.tensor(abs(top)).log2().floor().item() - 7)
    assert top - float(logits[got[k]]) <= steps * bf16_step, mismatch_report(model, prompt, ref, got)


def each_pass(gen, prompts: list[list[int]], max_new_tokens: int):
    """Drive one batch of ``gen`` pass by pass, as the engine's own loop does; once a pass has handed
    out its rows' tokens (before the next drafts), yield the batch this test holds, every row's text
    so far (prompt and accepted tokens) and the tokens each row got from the pass, keyed by row.
    Reads the batch the test holds, not the engine's last one."""
    batch = gen.start_batch(prompts, [max_new_tokens] * len(prompts), [None] * len(prompts))
    texts = {i: list(p) for i, p in enumerate(prompts)}
    try:
        while not batch.done:
            got = {}
            for row, new in gen.engine.step(batch):
                texts[row].extend(new)
                got[row] = new
                if row == batch.active[-1]:  # the pass's last running row: its rows are all out
                    yield batch, texts, got
    finally:
        gen.engine.finish(batch)


def tiny_tokenizer(vocab: int = 96):
    """A word-level tokenizer: w2 w3 ... are ids 2, 3, ...; 0 is <unk>, 1 is </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "</s>": 1} | {f"w{i}": i for i in range(2, vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def save_tiny_folder(path, vocab: int = 96, seed: int = 0, context: int = 512, hidden: int = 64, layers: int = 2):
    """A model folder like a user's: tiny random Llama + a word-level tokenizer (w0 w1 ...)."""
    model = tiny_llama(seed, vocab=vocab, context=context, eos=1, hidden=hidden, layers=layers)
    model.save_pretrained(path)
    tiny_tokenizer(vocab).save_pretrained(path)
    return path


# The CPU fast path's matmul kernels (speculant.models.cpu_kernels), each forced on any machine:
# "auto" is what this CPU picks (float32: the kernel core, where it builds); "onednn" oneDNN's packed
# copies; "fp32-blocks" is what bf16 gets on a CPU without oneDNN bf16 (AVX2), forced on AVX-512
# machines too; "aten" is plain F.linear everywhere.
KERNEL_CHOICES = ["auto", "onednn", "fp32-blocks", "aten"]


class Served:
    """``speculant serve``'s app over ``gen`` (named "tiny") in a uvicorn thread; ``close()`` stops it."""

    def __init__(self, gen, **kw):
        from speculant.server.app import create_app
        from speculant.server.background import BackgroundServer

        self.app = create_app(gen, "tiny", **kw)
        self.served = BackgroundServer(self.app)
        self.url = self.served.url

    @property
    def scheduler(self):
        return self.app.state.speculant["scheduler"]

    def client(self, key="none", **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def close(self):
        self.served.close()


def tiny_deepseek(version: int = 3, seed: int = 0, layers: int = 2, mtp_layers: int = 0):
    """A tiny random DeepSeek-V2/V3 causal LM: multi-head latent attention (query/key heads 16 wide,
    value heads 8 wide) and, from layer 1, a mixture of experts. ``mtp_layers``: the config's
    num_nextn_predict_layers (the weights of those layers live in a checkpoint, see test_mtp.py)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if version == 3:
        cfg = DeepseekV3Config(q_lora_rank=24, num_nextn_predict_layers=mtp_layers, **common)
        model = DeepseekV3ForCausalLM(cfg)
    else:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(q_lora_rank=None, **common))
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


# ---- OpenAI-style requests to a served tiny model, and the errors they must get ----
C, H = "/v1/completions", "/v1/chat/completions"
# what an error message must never show: a traceback, a library's words, a Python repr
LEAKS = ("Traceback", "Input should", "pydantic", "validation error", "lmformatenforcer", "TextEncodeInput",
         "unpack", "<class", "Exception", "internal error")


def completion(**kw):
    return {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0} | kw


def chat(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4} | kw


def post_json(url: str, body, **kw) -> httpx.Response:
    """POST ``body`` (JSON, NaN allowed; or raw bytes) as a client would."""
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60, **kw)


def assert_openai_error(r: httpx.Response, status: int, names: str | None = None) -> dict:
    """``r`` is an error in OpenAI's shape with this status: one clean line, naming ``names``."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["type"], str), err
    message = err["message"]
    assert isinstance(message, str) and message and "\n" not in message and len(message) < 400, message
    assert not any(leak in message for leak in LEAKS), message
    if names:
        assert names in message or names in (err["param"] or ""), err
    return err


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: a printable character for each of the 256 bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return [chr(c) for c in chars]


def write_tiny_gguf(path, types: dict | str = "Q8_0", arch: str = "llama", seed: int = 0, hidden: int = 256,
                    layers: int = 2, inner: int = 512, heads: int = 4, kv_heads: int = 2, tied: bool = False,
                    bias: bool = False):
    """A tiny causal LM's GGUF as llama.cpp writes one (gguf's writer): a byte-level BPE tokenizer (the 256
    byte tokens and <|endoftext|>, no merges), random weights in the GGML ``types`` given by tensor part
    ("attn_q", ..., "ffn_down", "token_embd", "output"; a str: all of them). Types gguf can quantize are
    random float weights quantized; the others (K-quants, IQ4_XS) random blocks of that type."""
    import gguf
    import numpy as np
    from gguf.constants import GGMLQuantizationType as T

    from speculant.models.quantized import random_gguf_blocks

    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output")
    types = {p: types for p in parts} if isinstance(types, str) else {p: "Q8_0" for p in parts} | types
    tokens = _byte_alphabet() + ["<|endoftext|>"]
    vocab, head_dim = len(tokens), hidden // heads
    g = torch.Generator().manual_seed(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inner)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 1)

    def weight(name: str, part: str, rows: int, cols: int):
        kind = types[part]
        if kind in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
            values = (torch.randn(rows, cols, generator=g) * 0.08).numpy()
            if kind == "F32":
                w.add_tensor(name, values)
                return
            if kind == "F16":
                w.add_tensor(name, values.astype(np.float16))
                return
            data = gguf.quants.quantize(values, T[kind])
        else:
            # scales below 2^-12: weights of a few hundredths, as a trained model's (larger ones saturate
            # the attention's softmax, where any rounding flips a row)
            data = random_gguf_blocks(kind, rows, cols, g, scale_bits=0x0C00)
            if kind == "Q6_K":  # its int8 sub-block scales 1..31, as a trained model's are: not ±127 apart
                blocks = data.reshape(-1, 210)
                blocks[:, 192:208] = torch.randint(1, 32, (len(blocks), 16), generator=g, dtype=torch.uint8).numpy()
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=T[kind])

    def floats(name: str, n: int, around: float = 1.0):
        w.add_tensor(name, (around + 0.1 * torch.randn(n, generator=g)).numpy().astype(np.float32))

    weight("token_embd.weight", "token_embd", vocab, hidden)
    for i in range(layers):
        floats(f"blk.{i}.attn_norm.weight", hidden)
        floats(f"blk.{i}.ffn_norm.weight", hidden)
        for part, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                                 ("ffn_gate", inner, hidden), ("ffn_up", inner, hidden), ("ffn_down", hidden, inner)):
            weight(f"blk.{i}.{part}.weight", part, rows, cols)
            if bias and part in ("attn_q", "attn_k", "attn_v"):
                floats(f"blk.{i}.{part}.bias", rows, 0.0)
    floats("output_norm.weight", hidden)
    if not tied:
        weight("output.weight", "output", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

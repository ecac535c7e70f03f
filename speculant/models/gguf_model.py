"""A GGUF read straight into the int8 kernels (``dtype="q8"``): no float32 copy of the model, in memory
or on disk.

The file is mapped, and each weight's blocks are repacked once into the int8 kernels' layout
(csrc/core/gguf.h: every common block type, exact to the file's own dequantisation) as it is read,
its pages given back as it goes, so a loaded model holds about the file's size (Q4_K_M: ~1.1x) and
a load takes seconds. The model object is a Hugging Face skeleton of the file's architecture: its
norms and biases are the file's (float32), its input embeddings a ``QuantEmbedding`` over their own
blocks, and its linear layers' weights stand-ins that hold no values (the fast path multiplies with
the packed blocks, ``speculant_quantized``); Hugging Face's own forward refuses to run on it. The
config, tokenizer and chat template come from the GGUF's metadata (Hugging Face's GGUF reading,
once; kept as a small folder of text files beside the dequantised models' cache).

Architectures: those whose decoder layer the fast path runs (``DIRECT_ARCHITECTURES``); another
GGUF loads as before (dequantised, ``loading``)."""
from __future__ import annotations

import mmap
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .. import files
from ..errors import SpeculantError
from . import quantized
from .gguf_file import GGUFTable, gguf_tensors, incomplete
from .quantized import DENSE_TYPES, Q8_TYPES, DenseWeight, PackedQ8, QuantEmbedding

# GGUF architectures read straight into the kernels (the fast path's decoder layer; "llama" covers
# Llama 2/3, Mistral, SmolLM and the other files llama.cpp converts as llama)
DIRECT_ARCHITECTURES = ("llama", "qwen2")
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# tensors a file may hold that the model does not use (llama.cpp's precomputed rotary factors: the
# config's rope parameters give the same)
UNUSED = ("rope_freqs.weight",)


def architecture(path: Path) -> str | None:
    """A GGUF's ``general.architecture`` from its header (milliseconds), or None where unreadable."""
    import struct

    scalars: dict = {}
    size = path.stat().st_size
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            from .gguf_file import _gguf_table

            _gguf_table(GGUFTable(m, size), incomplete(path, size), scalars)
    except (SpeculantError, struct.error, ValueError, OSError):
        return None
    arch = scalars.get("general.architecture")
    return arch if isinstance(arch, str) else None


def reads_directly(path: Path) -> bool:
    """Whether a .gguf file loads straight into the int8 kernels: an architecture the fast path runs,
    and the kernels built on this machine."""
    return architecture(path) in DIRECT_ARCHITECTURES and quantized.kernels() is not None


def _described_folder(path: Path, folder: Path) -> Path:
    """The folder of the GGUF's config, generation config and tokenizer (text files, a few MB), made
    from its metadata once with Hugging Face's GGUF reading (~15 s for a 150k-token vocabulary)."""
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    print(f"speculant: first use of {path.name}: reading its config and tokenizer from the file (once; kept in "
          f"{folder})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers raises many kinds for files it cannot read
        said = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise SpeculantError(f"{files.shown(path)}: its config or tokenizer could not be read ({said})") from None
    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    files.write_folder(folder, fill)
    print(f"speculant:   read in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return folder


def _head_order(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's q/k rows for its rotary: the order that undoes it
    (Hugging Face's row i is the file's row order[i]; transformers' reverse_permute)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(rows)


def _floats(t) -> torch.Tensor:
    """A dense GGUF tensor (F32, F16, BF16) as float32 [rows, dims[0]] (a copy: the file's pages go back)."""
    raw = np.ascontiguousarray(t.data)
    if t.kind == "F32":
        values = raw.view(np.float32)
    elif t.kind == "F16":
        values = raw.view(np.float16).astype(np.float32)
    elif t.kind == "BF16":
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(t.kind)
    return torch.from_numpy(values.reshape(-1, int(t.dims[0])).copy())


# a draft model's LM head of these types is rounded to quantized.DRAFT_BITS bits (a drafter's head is
# its biggest single weight: the 0.5B Qwen's Q8_0 output is 145 of its 390 MB packed, read every draft)
DRAFT_HEAD_TYPES = ("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K")


def _draft_head(head: PackedQ8, rows: int = 4096) -> PackedQ8:
    """A draft model's LM head rounded to ``quantized.DRAFT_BITS`` bits a weight (float16 scale and min a
    block of 32, as a drafter network's weights on the kernels are: ``quantized.kernel_linears``),
    ``rows`` at a time: its drafts change a little, the output does not (they are proposals)."""
    from .quantized import DRAFT_BITS, QuantLinear, QuantWeight

    n, k = head.shape
    packed = []
    for start in range(0, n, rows):
        part = QuantWeight.quantize(head.dequantize(torch.arange(start, min(n, start + rows))), DRAFT_BITS, halves=True)
        packed.append(QuantLinear(part, int8=True).args[0].reshape(-(-part.shape[0] // 16), -1))
    kind = 4 if DRAFT_BITS == 4 else 8  # q8.h's direct kinds: D4, D8
    return PackedQ8([torch.cat(packed)], [kind], [n], k, f"{head.source} as {DRAFT_BITS}-bit")


def _no_hf_forward(*args, **kwargs):
    raise SpeculantError("this model was read straight from its GGUF into the int8 kernels (dtype q8): it runs on "
                         "speculant's fast path only; for Hugging Face's own forward load it with dtype float32")


def _placeholder(shape) -> torch.nn.Parameter:
    """A linear layer's weight that holds no values (one float, strides 0): its shape and dtype for
    whoever asks, its multiplications done by the packed blocks."""
    return torch.nn.Parameter(torch.zeros((), dtype=torch.float32).expand(*shape), requires_grad=False)


class _Pages:
    """The file's map, its pages given back as each tensor is packed: a loaded model's resident
    memory is then its packed weights, not those plus the file."""

    def __init__(self, m: mmap.mmap):
        self.m = m

    def give_back(self, at: int, nbytes: int) -> None:
        start = at - at % mmap.PAGESIZE
        try:
            self.m.madvise(mmap.MADV_DONTNEED, start, at + nbytes - start)
        except (AttributeError, OSError, ValueError):  # a platform without it: the kernel reclaims them later
            pass


def load_direct(path: Path, folder: Path, draft: bool = False):
    """(model, tokenizer) of a GGUF read straight into the int8 kernels; ``folder``: where its config and
    tokenizer are kept. ``draft``: the model only drafts, and an LM head of more than
    ``quantized.DRAFT_BITS`` bits a weight (a Q8_0 or Q6_K output) is rounded to them (``_draft_head``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.generation import GenerationConfig

    if quantized.kernels() is None:
        raise SpeculantError("dtype 'q8' needs the compiled CPU kernels (a C++ compiler and ninja; see the message "
                             "above): use float32 or bfloat16")
    folder = _described_folder(path, folder)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    t0 = time.perf_counter()
    mapped: list = []
    tensors = gguf_tensors(path, mapped=mapped)
    pages = _Pages(mapped[0])
    arch = architecture(path)
    types: dict[str, int] = {}
    for t in tensors:
        if t.name.endswith(".weight") and len(t.dims) == 2:
            types[t.kind] = types.get(t.kind, 0) + 1
    print(f"speculant: reading {path.name} ({path.stat().st_size / 1e9:.2f} GB: "
          f"{', '.join(f'{k} x{v}' for k, v in sorted(types.items()))}) straight into the int8 kernels",
          file=sys.stderr, flush=True)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    inner = model.model
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    modules = dict(model.named_modules())
    weights: dict[str, PackedQ8 | DenseWeight] = {}
    by_name = {t.name: t for t in tensors}

    def bad(name: str, why: str) -> SpeculantError:
        return SpeculantError(f"{files.shown(path)}: tensor {name} {why}: load it with dtype float32")

    def linear_weight(t, order: np.ndarray | None, into: torch.Tensor | None = None):
        if t.kind in Q8_TYPES:
            raw = np.asarray(t.data) if order is None else np.ascontiguousarray(np.asarray(t.data)[order])
            try:
                return PackedQ8.of_gguf(t.kind, t.type_id, raw, int(t.dims[0]), into)
            except RuntimeError as e:
                raise bad(t.name, f"could not be repacked ({str(e).splitlines()[0]})") from None
        if t.kind in DENSE_TYPES:
            dense = _floats(t)
            dense = dense if order is None else dense[torch.from_numpy(order)]
            return DenseWeight.bfloat16_of(dense) if t.kind == "BF16" else DenseWeight(dense.contiguous())
        raise bad(t.name, f"is {t.kind}, a type the int8 kernels do not take ({', '.join(Q8_TYPES + DENSE_TYPES)})")

    # the weights the fast path stacks (q/k/v, gate/up) packed side by side in one buffer a layer: its
    # stacking then takes views of them, not copies (a model holds each weight once)
    into: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        for group in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")):
            members = [by_name.get(f"blk.{i}.{part}.weight") for part in group]
            if not all(m is not None and m.kind in Q8_TYPES and m.dims[0] == members[0].dims[0] for m in members):
                continue
            sizes = [-(-int(np.prod(m.dims[1:])) // 16) * PackedQ8.group_bytes(m.type_id, int(m.dims[0])) for m in members]
            buffer, start = torch.empty(sum(sizes), dtype=torch.uint8), 0
            for m, size in zip(members, sizes):
                into[m.name] = buffer[start : start + size].view(-1, PackedQ8.group_bytes(m.type_id, int(m.dims[0])))
                start += size

    used = set(UNUSED)
    for t in tensors:
        if not t.name.startswith("blk."):
            continue
        _, layer, part, what = (t.name.split(".", 3) + [""])[:4]
        prefix = f"model.layers.{layer}."
        order = None
        if arch == "llama" and part in ("attn_q", "attn_k"):
            order = _head_order(int(np.prod(t.dims[1:])), heads if part == "attn_q" else kv_heads)
        if part in LINEARS and what == "weight":
            weights[prefix + LINEARS[part]] = linear_weight(t, order, into.get(t.name))
            module = modules.get(prefix + LINEARS[part])
            if module is None:
                raise bad(t.name, "has no place in the model")
            module.weight = _placeholder(weights[prefix + LINEARS[part]].shape)
        elif part in LINEARS and what == "bias":
            bias = _floats(t).view(-1)
            modules[prefix + LINEARS[part]].bias = torch.nn.Parameter(
                bias if order is None else bias[torch.from_numpy(order)], requires_grad=False)
        elif part in NORMS and what == "weight":
            modules[prefix + NORMS[part]].weight = torch.nn.Parameter(_floats(t).view(-1), requires_grad=False)
        else:
            continue
        used.add(t.name)
        pages.give_back(t.at, t.data.nbytes)

    embed = by_name.get("token_embd.weight")
    if embed is None:
        raise SpeculantError(f"{files.shown(path)} has no token_embd.weight: not a causal language model's GGUF")
    if embed.kind in Q8_TYPES:
        table = PackedQ8.of_gguf(embed.kind, embed.type_id, np.asarray(embed.data), int(embed.dims[0]))
        inner.embed_tokens = QuantEmbedding(table)
    elif embed.kind in DENSE_TYPES:
        table = DenseWeight(_floats(embed))
        inner.embed_tokens = torch.nn.Embedding.from_pretrained(table.tensor, freeze=True)
    else:
        raise bad(embed.name, f"is {embed.kind}, a type the int8 kernels do not take")
    pages.give_back(embed.at, embed.data.nbytes)
    head = by_name.get("output.weight")
    weights["lm_head"] = linear_weight(head, None) if head is not None else table
    if draft and isinstance(weights["lm_head"], PackedQ8) and weights["lm_head"].source in DRAFT_HEAD_TYPES:
        weights["lm_head"] = _draft_head(weights["lm_head"])
    if head is not None:
        pages.give_back(head.at, head.data.nbytes)
    model.get_output_embeddings().weight = _placeholder(weights["lm_head"].shape)
    norm = by_name.get("output_norm.weight")
    if norm is None:
        raise SpeculantError(f"{files.shown(path)} has no output_norm.weight")
    inner.norm.weight = torch.nn.Parameter(_floats(norm).view(-1), requires_grad=False)
    used |= {"token_embd.weight", "output.weight", "output_norm.weight"}
    inner.rotary_emb = type(inner.rotary_emb)(config=cfg)

    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    missing += [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if missing:
        raise SpeculantError(f"{files.shown(path)}: no tensor for {', '.join(missing[:4])}"
                             f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''} (an architecture "
                             "variant this reader does not know): load it with dtype float32")
    unread = [t.name for t in tensors if t.name not in used]
    if unread:
        print(f"speculant: {path.name}: tensors not used: {', '.join(unread[:6])}", file=sys.stderr, flush=True)
    del tensors, by_name
    model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    model.config._name_or_path = str(folder)
    model.speculant_quantized = weights
    model.speculant_int8 = True
    model.speculant_gguf = path
    model.forward = model.generate = _no_hf_forward
    packed = sum(w.nbytes for w in {id(w): w for w in weights.values()}.values())
    print(f"speculant:   {packed / 1e9:.2f} GB packed in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return model, tokenizer


def is_direct(model: torch.nn.Module) -> bool:
    """Whether a model was read straight from its GGUF into the kernels (no dense weights to fall back on)."""
    return getattr(model, "speculant_gguf", None) is not None

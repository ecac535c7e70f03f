"""A GGUF's weights kept quantized on the CPU fast path (``dtype="quantized"``).

Dequantising a GGUF to bf16 or float32 makes every token stream 3-6x the bytes of the file itself.
Here the linear layers keep the file's blocks and multiply with them directly
(``csrc/core/quant.h``): activations, norms, attention and the KV cache stay float32 (``q8``, int8
activations, keeps a float16 cache: ``FastLlama.cache_dtype``).

One layout serves the formats: blocks of 32 inputs, w = scale * q + min with a float32 scale and
min per block, 4-bit codes (two to a byte) or 8-bit ones. Q4_0, Q4_1, Q4_K and Q8_0 map onto it
exactly (a Q4_K super-block's 6-bit scales and mins become each sub-block's float32 products;
Q4_0's offset of 8 becomes min = -8 * scale), so the weights the kernel multiplies with are the
dequantised model's, bit for bit: ``read`` proves it per tensor against the model loaded from the
same file, and a tensor that does not match (or of another format: Q5, Q6_K) stays dense.

The kernels give each row the same bits at any width by construction (a block's weights are
dequantized in registers, one rounding each; every row takes its dot product with them in fixed
lanes and a fixed order; norms, rotary and SiLU work a row at a time): the fast path checks the LM
head per machine like any other matmul (``invariant.linear_rows``) and the whole forward at the
first request (``FastLlama.proves_invariance``).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import native

BLOCK = 32
FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
ENV = "SPECULANT_QUANTIZED_KERNEL"  # "torch": dequantize and F.linear instead of the compiled kernel (tests)


@dataclass
class QuantWeight:
    """A weight [out, in] as blocks of 32 inputs: w = scale * code + min (float32 scale and min)."""

    codes: torch.Tensor  # uint8 [out, in / 2] (4-bit: byte i of a block holds inputs i and 16 + i) or [out, in] (8-bit, signed)
    scale: torch.Tensor  # float32 [out, in / 32]
    min: torch.Tensor  # float32 [out, in / 32]
    bits: int
    source: str  # the GGUF format it came from

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.scale.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min))

    def signed_codes(self) -> torch.Tensor:
        """The codes one per input, [out, in] (uint8 0..15 or int8)."""
        if self.bits == 8:
            return self.codes.view(torch.int8)
        n, half = self.codes.shape
        blocks = self.codes.view(n, half // 16, 16)
        return torch.cat([blocks & 15, blocks >> 4], -1).view(n, 2 * half)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (one rounding a weight, as the kernel's)."""
        n, k = self.shape
        q = self.signed_codes().float().view(n, k // BLOCK, BLOCK)
        return (q * self.scale[..., None] + self.min[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> "QuantWeight":
        return QuantWeight(self.codes[index].contiguous(), self.scale[index].contiguous(),
                           self.min[index].contiguous(), self.bits, self.source)

    @staticmethod
    def stacked(parts: list["QuantWeight"]) -> "QuantWeight":
        """One weight for several that read the same input (q/k/v, gate/up): rows stacked. Each output
        is its own dot product in the kernel, so stacking changes no bits."""
        return QuantWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                           torch.cat([p.min for p in parts]), parts[0].bits, parts[0].source)

    @staticmethod
    def quantize(weight: torch.Tensor, bits: int, halves: bool = False) -> "QuantWeight":
        """Round a dense weight to this layout (affine 4-bit or symmetric 8-bit per block): for
        drafters beside a quantized target, and the checks and tests, which need a kernel over
        weights of their own. ``halves``: scales and mins rounded to float16 first (as GGUF's are:
        the int8 kernels then stream 2 bytes of each instead of 4)."""
        n, k = weight.shape
        w = weight.detach().float().view(n, k // BLOCK, BLOCK)

        def rounded(x):
            return torch.where(x.half().float() > 0, x.half().float(), 2.0 ** -24) if halves else x

        if bits == 8:
            scale = rounded((w.abs().amax(-1) / 127).clamp_min(1e-8))
            codes = (w / scale[..., None]).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
            return QuantWeight(codes.view(n, k), scale, torch.zeros_like(scale), 8, "Q8")
        lo, hi = w.amin(-1), w.amax(-1)
        lo = lo.half().float() if halves else lo
        scale = rounded(((hi - lo) / 15).clamp_min(1e-8))
        q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return QuantWeight(_pack_nibbles(q), scale, lo, 4, "Q4")


@dataclass
class DenseWeight:
    """A float32 model's own weight [out, in] for the kernels as it is held (``bits`` 32: not packed,
    no copy), or its values in bfloat16 where each is one (``bits`` 16, ``bfloat16_of``: a bf16
    checkpoint's, half the bytes, widened exactly). The kernels multiply it in the order of a block's
    dequantised weights, so a dequantised GGUF's float32 model gets its blocks' very bits
    (``dense_weights``)."""

    tensor: torch.Tensor

    @property
    def bits(self) -> int:
        return 16 if self.tensor.dtype == torch.bfloat16 else 32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def dequantize(self) -> torch.Tensor:
        if self.bits == 32:
            return self.tensor
        n, k = self.shape
        return self.tensor.view(n, k // 16, 8, 2).transpose(-1, -2).reshape(n, k).float()

    @staticmethod
    def bfloat16_of(weight: torch.Tensor) -> "DenseWeight":
        """A weight's values (bfloat16 ones, or rounded to them) in bfloat16, in the kernels' layout:
        inputs j and 8 + j of each 16 side by side (csrc/core/quant.h), so AVX2 widens 16 of them with
        one load, a shift and a mask."""
        n, k = weight.shape
        paired = weight.detach().bfloat16().view(n, k // 16, 2, 8).transpose(-1, -2).reshape(n, k).contiguous()
        return DenseWeight(paired)

    @staticmethod
    def stacked(parts: list["DenseWeight"]) -> "DenseWeight":
        """One weight for several (q/k/v, gate/up): rows stacked; a view where they already lie one
        after another in one storage (a model another fast path stacked: ``fast.core_kernels``)."""
        first = parts[0].tensor
        at, storage = first.data_ptr(), first.untyped_storage().data_ptr()
        for p in parts:
            if not p.tensor.is_contiguous() or p.tensor.data_ptr() != at or p.tensor.untyped_storage().data_ptr() != storage:
                return DenseWeight(torch.cat([p.tensor for p in parts]))
            at += p.nbytes
        rows = sum(p.shape[0] for p in parts)
        view = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]))
        return DenseWeight(view)


# GGML block types the int8 kernels take straight from a GGUF (csrc/core/gguf.h: each type's q8 kind);
# F32, F16 and BF16 tensors run as dense weights (``DenseWeight``)
Q8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
DENSE_TYPES = ("F32", "F16", "BF16")
# where each block type keeps its float16 fields (scales, mins): (bytes a block, [offsets]) for
# ``random_gguf_blocks``
_HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
                "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}


def random_gguf_blocks(kind: str, rows: int, in_features: int, generator: torch.Generator,
                       scale_bits: int = 0x2000) -> np.ndarray:
    """Rows of random blocks of a GGML type (uint8 [rows, bytes a row]): random codes and bits, with
    its float16 scales and mins finite and below the half ``scale_bits`` (2^-7; subnormals included,
    either sign), so that sums stay finite: the checks' and the tests' weights of every type."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    n_blocks = rows * in_features // block
    raw = torch.randint(0, 256, (n_blocks, nbytes), generator=generator, dtype=torch.uint8).numpy()
    for at in _HALF_FIELDS.get(kind, [0]):  # another type (a test's): its first two bytes, as most have
        bits = torch.randint(0, scale_bits, (n_blocks,), generator=generator, dtype=torch.int32).numpy()
        sign = torch.randint(0, 2, (n_blocks,), generator=generator, dtype=torch.int32).numpy() << 15
        raw[:, at : at + 2] = (bits | sign).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, -1)


@dataclass
class PackedQ8:
    """A weight [out, in] in the int8 kernels' layout (csrc/core/q8.h), packed there from a GGUF
    tensor's own blocks (csrc/core/gguf.h), as exact as the file: up to three parts of different
    block types side by side (q/k/v or gate/up of a file whose tensors differ in type)."""

    parts: list[torch.Tensor]  # uint8 [groups of 16 outputs, bytes a group], one per part
    kinds: list[int]  # each part's q8 kind (csrc/core/q8.h's Q8KindId)
    outs: list[int]  # each part's outputs
    in_features: int
    source: str  # the GGUF block type(s)

    @property
    def bits(self) -> int:
        """What the kernels take as the weight's kind: each part's, a byte each (kernels.cpp's linear_of)."""
        return sum(k << (8 * i) for i, k in enumerate(self.kinds))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(self.outs), self.in_features

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parts)

    @staticmethod
    def group_bytes(type_id: int, in_features: int) -> int:
        """Bytes of a group of 16 outputs in ``of_gguf``'s packing of a tensor of a GGML type."""
        return kernels().gguf_group_bytes(type_id, in_features)

    @staticmethod
    def of_gguf(kind: str, type_id: int, raw: np.ndarray, in_features: int, out: torch.Tensor | None = None) -> "PackedQ8":
        """A GGUF tensor's raw blocks (uint8 [out, bytes a row]) repacked by the kernels (into ``out``, a
        uint8 [groups, bytes a group] view, where given: tensors a model stacks packed side by side)."""
        import warnings

        with warnings.catch_warnings():  # the file's map is read-only, and the kernel only reads it
            warnings.simplefilter("ignore", UserWarning)
            raw_tensor = torch.from_numpy(raw)
        k = kernels()
        packed = k.gguf_pack(raw_tensor, type_id, in_features, torch.empty(0, dtype=torch.uint8) if out is None else out)
        return PackedQ8([packed], [k.gguf_kind(type_id)], [raw.shape[0]], in_features, kind)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (or its ``rows``): each value the file's own dequantisation."""
        k = kernels()
        rows = torch.arange(self.shape[0]) if rows is None else rows.to(torch.long)
        out, start = torch.empty(len(rows), self.in_features), 0
        for packed, kind, n in zip(self.parts, self.kinds, self.outs):
            here = (rows >= start) & (rows < start + n)
            if bool(here.any()):
                out[here] = k.q8_dequantize([packed, torch.zeros(n)], kind, self.in_features, rows[here] - start)
            start += n
        return out

    def random_like(self, outs: int, seed: int = 0) -> "PackedQ8":
        """A weight of random blocks of the same kinds side by side, at most ``outs`` outputs in all (each
        part but the last a whole number of groups): the width checks' stand-in (``fast._window``)."""
        g = torch.Generator().manual_seed(seed)
        share = max(Q8_GROUP, outs // len(self.parts) // Q8_GROUP * Q8_GROUP)
        parts = []
        for i, (kind, n) in enumerate(zip(self.kinds, self.outs)):
            rows = min(n, share if i + 1 < len(self.parts) else max(1, outs - share * i))
            name = next(t for t in Q8_TYPES if kernels().gguf_kind(_GGML_TYPE_IDS[t]) == kind)
            parts.append(PackedQ8.of_gguf(name, _GGML_TYPE_IDS[name], random_gguf_blocks(name, rows, self.in_features, g),
                                          self.in_features))
        return PackedQ8.stacked(parts)

    @staticmethod
    def stacked(parts: list["PackedQ8"]) -> "PackedQ8":
        """One weight for several that read the same input (q/k/v, gate/up): parts of one kind that
        follow a whole number of groups are joined (fewer parallel loops), others kept side by side.
        The weights given become views of the joined ones (their own copies freed: a model holds each
        weight once)."""
        out = PackedQ8([], [], [], parts[0].in_features, "+".join(dict.fromkeys(p.source for p in parts)))
        joined: list[list[tuple[PackedQ8, int]]] = []  # per part of out: (weight given, its part index)
        for w in parts:
            for i, (packed, kind, n) in enumerate(zip(w.parts, w.kinds, w.outs)):
                if out.kinds and out.kinds[-1] == kind and out.outs[-1] % Q8_GROUP == 0:
                    out.parts[-1].append(packed)
                    out.outs[-1] += n
                    joined[-1].append((w, i))
                else:
                    out.parts.append([packed]), out.kinds.append(kind), out.outs.append(n)
                    joined.append([(w, i)])
        if len(out.parts) > 3:
            raise ValueError("at most three kinds side by side")
        for n in out.outs[:-1]:
            if n % Q8_GROUP:
                raise ValueError("parts side by side need whole groups of 16 outputs")
        for j, tensors in enumerate(out.parts):
            out.parts[j] = _joined(tensors)
            start = 0
            for (w, i), t in zip(joined[j], tensors):
                w.parts[i] = out.parts[j][start : start + len(t)]
                start += len(t)
        return out


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Packed weights [groups, bytes] one after another: a view where they lie so in one storage
    (packed side by side as they were read: ``gguf_model``), else a copy."""
    first = tensors[0]
    at = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != at or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return torch.cat(tensors)
        at += t.numel()
    rows = sum(len(t) for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]))


_GGML_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
                  "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}


class QuantEmbedding(torch.nn.Module):
    """A model's input embeddings as the GGUF keeps them (a ``PackedQ8``): a token's row is dequantized
    when it is looked up (the file's own values), and the whole table (151,936 x 1,536 floats would
    be 0.9 GB) is made only where something asks for ``weight`` (an EAGLE head's drafting)."""

    def __init__(self, packed: PackedQ8):
        super().__init__()
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.shape
        self._dense = None

    @property
    def weight(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.packed.dequantize()
        return self._dense

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self._dense is not None:
            return self._dense[flat].view(*ids.shape, -1)
        return self.packed.dequantize(flat).view(*ids.shape, -1)


def _dense_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear] | None:
    """A float32 CPU model's linear layers by name, where the kernels can take every one (input
    widths a multiple of 32, contiguous float32 weights), else None."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    ok = linears and all(m.in_features % BLOCK == 0 and m.weight.dtype == torch.float32
                         and m.weight.device.type == "cpu" and m.weight.is_contiguous() for m in linears.values())
    return linears if ok else None


# a float32 model whose every linear weight is a bfloat16 value (a bf16 checkpoint loaded in float32)
# keeps bfloat16 copies for the kernels: a pass streams half the bytes for the very same bits (False:
# the float32 weights themselves, the A/B scripts' and tests' twin)
BF16_WEIGHTS = True


def dense_weights(model: torch.nn.Module) -> dict[str, DenseWeight] | None:
    """Every linear layer of a float32 CPU model as the kernels take it, by module name (as
    ``weights_of``), or None where they cannot: no kernels, another dtype, a linear whose input
    width is not a multiple of 32. Where every weight's values are bfloat16 ones (``BF16_WEIGHTS``)
    and a bfloat16 copy (half the float32 bytes) fits in a quarter of the free memory, that copy."""
    from .cpu_kernels import available_bytes

    linears = _dense_linears(model)
    if linears is None or kernels() is None:
        return None
    head = model.get_output_embeddings()
    weights = {id(m.weight): m.weight.detach() for m in linears.values()}  # a tied weight once
    half = BF16_WEIGHTS and sum(w.numel() * 2 for w in weights.values()) <= available_bytes() // 4 and all(
        torch.equal(w.bfloat16().float(), w) for w in weights.values())
    held = {k: DenseWeight.bfloat16_of(w) if half else DenseWeight(w) for k, w in weights.items()}
    return {("lm_head" if m is head else n): held[id(m.weight)] for n, m in linears.items()}


@functools.cache
def kernels():
    """The compiled kernels (``native``: quant_linear; layer, a decoder layer in one call;
    layer_start and layer_end around attention in PyTorch ops; norm), or None (no compiler, or
    $SPECULANT_QUANTIZED_KERNEL=torch)."""
    if os.environ.get(ENV, "auto") == "torch":
        return None
    return native.build()


def build(isa: tuple[str, ...] = ()):
    """The kernels built for this CPU, or with ``isa`` flags on top (``-mno-avx512f``: the AVX2 branch,
    which the tests build on any x86 CPU)."""
    return native.build(isa)


class QuantLinear:
    """A linear layer over a ``QuantWeight`` or a ``DenseWeight`` (float32 in and out), shaped like
    cpu_kernels.PackedLinear.
    ``int8``: each row of x is quantized to int8 in blocks of 32 and multiplied in integers (``q8``).
    Without the compiled kernel: the dequantised weight and ``F.linear`` (slow, and not the kernel's bits)."""

    def __init__(self, weight: QuantWeight | DenseWeight | PackedQ8, bias: torch.Tensor | None = None,
                 int8: bool = False):
        self.weight, self.int8 = weight, int8 or isinstance(weight, PackedQ8)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._dense = None
        k = kernels()
        if k is not None:  # the kernel's arguments: the weight packed for streaming, a bias (zeros for none)
            bias = self.bias if self.bias is not None else torch.zeros(self.out_features)
            if isinstance(weight, PackedQ8):
                self.args = [*weight.parts, bias]
                return
            packed = weight.tensor if isinstance(weight, DenseWeight) else pack_int8(weight) if int8 else pack(
                weight, k.group_size())
            self.args = [packed, bias]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = kernels()
        if k is None:
            if self._dense is None:
                self._dense = self.weight.dequantize()
            return torch.nn.functional.linear(x, self._dense, self.bias)
        y = k.quant_linear(x.reshape(-1, self.in_features).contiguous(), self.args, self.weight.bits)
        return y.view(*x.shape[:-1], self.out_features)


Q8_GROUP = 16  # outputs a group of the int8 kernels' layout holds (csrc/core/q8.h)


def on_kernel_core(model: torch.nn.Module, choice: str | None = None) -> bool:
    """Whether a model's passes run its own weights on the kernel core (``fast.choose_kernels``): a
    float32 CPU model, the CPU kernel ``choice`` (default ``SPECULANT_CPU_KERNELS``) auto or core, the
    kernels built, every linear one they take (``dense_weights``)."""
    from .cpu_kernels import requested

    p = next(model.parameters(), None)
    return (p is not None and p.device.type == "cpu" and p.dtype == torch.float32
            and kernels() is not None and requested(choice) in ("auto", "core") and _dense_linears(model) is not None)


def drafts_on_kernels(target: torch.nn.Module) -> bool:
    """Whether draft networks beside this target run their linears on the CPU kernels (``kernel_linears``),
    where the kernels build: beside a quantized target (a draft network on oneDNN's dense matmuls cost
    more than the quantized target's own pass), and beside a float32 model on the kernel core
    (``on_kernel_core``): an EAGLE head there cost ~8 ms a pass in float32 beside the target's ~17 on
    a 2-core Zen 3. Their drafts change a little (proposals only: the output does not);
    ``SPECULANT_CPU_KERNELS=onednn`` keeps them float32."""
    return (bool(weights_of(target)) and kernels() is not None) or on_kernel_core(target)


# a drafter's weights on the kernels (``kernel_linears``): at 4 bits the EAGLE head drafts ~0.2 ms a
# pass faster than at 8 (half the bytes read cold after the target's pass) at a chain τ 0.03 lower,
# eagle@2 +2.6-2.9 % and eagle+ngram +0.6-1.5 % beside q8 on all 167 bench prompts, level beside
# float32 (benchmarks/results/cpu-AVX512BF16-2026-12-06-zen4-head-bits/)
DRAFT_BITS = 4


def kernel_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Give every ``nn.Linear`` of a small float32 CPU network (a drafter's) a forward through the
    int8 kernels over its weights rounded to ``DRAFT_BITS`` bits per block of 32, float16 scales
    (``QuantWeight.quantize``): a draft network then streams about a quarter of its float32 bytes
    and multiplies in integers, as the
    target does. Its drafts change a little (they are only proposals: the output does not). q/k/v and
    gate/up of a module that declares a slot for them (trained.blocks) become one matmul each.
    Linears whose input width is not a multiple of 32 keep ``F.linear``. The weights stay as they
    are (state dicts unchanged)."""
    from .cpu_kernels import STACKED

    def quantized_linear(parts: list[torch.nn.Linear]):
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach().float() if b is not None else torch.zeros(p.out_features) for p, b in zip(parts, biases)])
        weight = torch.cat([p.weight.detach().float() for p in parts])
        return QuantLinear(QuantWeight.quantize(weight, DRAFT_BITS, halves=True), bias, int8=True)

    stacked = set()
    for m in module.modules():
        for slot, names in STACKED.items():
            parts = [getattr(m, n, None) for n in names]
            if hasattr(m, slot) and all(isinstance(p, torch.nn.Linear) and p.in_features % BLOCK == 0 for p in parts):
                setattr(m, slot, quantized_linear(parts))
                stacked.update(map(id, parts))
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and id(m) not in stacked and m.in_features % BLOCK == 0:
            m.forward = quantized_linear([m])
    return module


def pack_int8(w: QuantWeight, halves: bool = True) -> torch.Tensor:
    """The int8-activation kernels' layout (csrc/core/q8.h): outputs in groups of 16 (zero rows fill
    the last), and per group, block after block: 16 scales, 16 mins (4-bit only), then the codes, an
    output's 4 inputs in each int32 lane: 4-bit, 4 chunks x 16 outputs x 4 bytes whose low nibbles are
    inputs 8c + j and high nibbles 8c + 4 + j; 8-bit, 8 chunks x 16 outputs x 4 bytes (inputs 4c + j).
    Scales and mins are float16 where every one is a half (Q4_0, Q4_1, Q8_0: fewer bytes to stream,
    the same bits), else float32 (K-quants' products, a drafter's rounding). uint8 [groups, blocks,
    bytes a block]. ``halves=False``: float32 scales even where halves would do (the tests' twin)."""
    n, k = w.shape
    blocks, pad = k // BLOCK, -n % Q8_GROUP
    groups = (n + pad) // Q8_GROUP
    codes = torch.nn.functional.pad(w.signed_codes().view(torch.uint8), (0, 0, 0, pad))
    scale, low = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (w.scale, w.min))
    if halves and all(torch.equal(t.half().float(), t) for t in (scale, low)):
        scale, low = scale.half(), low.half()

    def by_group(t: torch.Tensor) -> torch.Tensor:  # [n, blocks, ...] -> [groups, blocks, 16, ...]
        return t.view(groups, Q8_GROUP, blocks, *t.shape[2:]).transpose(1, 2)

    if w.bits == 4:
        q = codes.view(-1, blocks, 4, 2, 4)  # [n, block, chunk c, half, j]: input 8c + 4 * half + j
        lanes = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [n, block, chunk, 4 bytes]
    else:
        lanes = codes.view(-1, blocks, 8, 4)
    lanes = by_group(lanes).transpose(2, 3)  # [groups, blocks, chunk, 16 outputs, 4 bytes]
    parts = [by_group(scale.contiguous().view(-1, blocks, 1).view(torch.uint8))]
    if w.bits == 4:
        parts.append(by_group(low.contiguous().view(-1, blocks, 1).view(torch.uint8)))
    parts.append(lanes)
    return torch.cat([p.reshape(groups, blocks, -1) for p in parts], -1).contiguous()


def pack(w: QuantWeight, group: int) -> torch.Tensor:
    """The kernel's layout: outputs in groups of ``group`` (zero rows fill the last), and per group,
    block after block, each output's record: float32 scale, float32 min, its codes.
    uint8 [groups, blocks, group, record]."""
    n, k = w.shape
    blocks, pad = k // BLOCK, -n % group
    codes = w.codes.view(n, blocks, -1)
    record = torch.cat([w.scale[..., None].view(torch.uint8), w.min[..., None].view(torch.uint8), codes], -1)
    record = torch.nn.functional.pad(record, (0, 0, 0, 0, 0, pad))
    return record.view(-1, group, blocks, record.shape[-1]).transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------------
# reading a GGUF


def _halves(blocks: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """codes [n, blocks, 32] (0..15) -> bytes [n, blocks * 16]: byte i holds codes i and 16 + i."""
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1).contiguous()


def _k4_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def from_gguf_blocks(kind: str, data: np.ndarray, in_features: int) -> QuantWeight:
    """A GGUF tensor's raw blocks (uint8 [out, bytes a row]) in this module's layout."""
    n = data.shape[0]
    nb = in_features // BLOCK
    if kind == "Q8_0":
        b = data.reshape(n, nb, 34)
        codes = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).reshape(n, in_features))
        scale = _halves(b, 0)
        return QuantWeight(codes, scale, torch.zeros_like(scale), 8, kind)
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        b = data.reshape(n, nb, size)
        codes = torch.from_numpy(np.ascontiguousarray(b[..., size - 16 :]).reshape(n, nb * 16))
        scale = _halves(b, 0)
        low = -8 * scale if kind == "Q4_0" else _halves(b, 2)
        return QuantWeight(codes, scale, low, 4, kind)
    if kind == "Q4_K":
        b = data.reshape(n, in_features // 256, 144)
        d, dmin = _halves(b, 0), _halves(b, 2)
        sc, mn = _k4_scales(b[..., 4:16])
        scale = (d[..., None] * torch.from_numpy(sc)).reshape(n, nb)
        low = -(dmin[..., None] * torch.from_numpy(mn)).reshape(n, nb)
        qs = torch.from_numpy(np.ascontiguousarray(b[..., 16:])).view(n, -1, 4, 32)  # 4 chunks of 64 inputs
        q = torch.stack([qs & 15, qs >> 4], 3).reshape(n, nb, BLOCK)  # low nibbles: the chunk's first 32
        return QuantWeight(_pack_nibbles(q), scale, low, 4, kind)
    raise ValueError(f"no quantized kernel for {kind}")


LLAMA_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def gguf_source(model: torch.nn.Module) -> Path | None:
    """The GGUF file a model was loaded from (``loading`` records it beside the dequantised weights)."""
    folder = Path(getattr(model.config, "_name_or_path", "") or ".")
    try:
        return Path(json.loads((folder / "speculant-source.json").read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _head_orders(n: int, cfg) -> list[torch.Tensor | None]:
    """Row orders a GGUF q/k weight may need: none, or llama.cpp's rotary interleave undone per head."""
    orders: list[torch.Tensor | None] = [None]
    for heads in {cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}:
        if n % (2 * heads) == 0:
            orders.append(torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n))
    return orders


def weights_of(model: torch.nn.Module) -> dict[str, QuantWeight] | None:
    """The quantized weights a model loaded with ``dtype="quantized"`` or ``"q8"`` carries (``loading``),
    by module name, or None: a model on dense weights."""
    return getattr(model, "speculant_quantized", None)


def int8_activations(model: torch.nn.Module) -> bool:
    """Whether a model's quantized weights multiply int8-quantized activations (``dtype="q8"``)."""
    return bool(getattr(model, "speculant_int8", False))


def read(model: torch.nn.Module, path: Path | None = None) -> dict[str, QuantWeight]:
    """The quantized weights of ``model``'s linear layers from its GGUF, by module name
    ("model.layers.0.self_attn.q_proj", "lm_head"): only those whose dequantised values equal the
    model's own weights bit for bit (the model must be float32). Empty where the model has no GGUF."""
    from .gguf_file import gguf_tensors

    path = path or gguf_source(model)
    if path is None or not path.is_file():
        return {}
    modules = dict(model.named_modules())
    out: dict[str, QuantWeight] = {}
    tensors = gguf_tensors(path)
    tied = not any(t.name == "output.weight" for t in tensors)
    for t in tensors:
        kind = t.kind
        base = t.name.removesuffix(".weight")
        if kind not in FORMATS or not t.name.endswith(".weight"):
            continue
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            if part not in LLAMA_NAMES:
                continue
            name = f"model.layers.{layer}.{LLAMA_NAMES[part]}"
        elif base == "output" or (base == "token_embd" and tied):
            name = "lm_head"
        else:
            continue
        module = modules.get(name)
        dense = getattr(module, "weight", None)
        if dense is None or dense.dtype != torch.float32 or dense.dim() != 2:
            continue
        w = from_gguf_blocks(kind, np.asarray(t.data), int(t.dims[0]))
        if w.shape != tuple(dense.shape):
            continue
        for order in _head_orders(w.shape[0], model.config) if ".q_proj" in name or ".k_proj" in name else [None]:
            cand = w if order is None else w.rows(order)
            if torch.equal(cand.dequantize(), dense.detach()):
                out[name] = cand
                break
    return out


def describe(weights: dict[str, QuantWeight], dense_linears: int) -> str:
    """"Q4_1 x210, Q8_0 x1 (+3 dense)": what the quantized path multiplies with."""
    counts: dict[str, int] = {}
    for w in weights.values():
        counts[w.source] = counts.get(w.source, 0) + 1
    text = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    return text + (f" (+{dense_linears} dense)" if dense_linears else "")

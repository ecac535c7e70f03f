"""Which matmul kernels the CPU fast path runs, decided per machine (the CPU's ISA, this torch build).

oneDNN can keep a weight reordered once ("packed") into the blocked layout its matmul kernels read.
Decoding and verification then skip ``F.linear``'s per-call work and, in float32, a verify block of
2-9 tokens costs little more than one token (MKL's ``F.linear`` costs ~1.6x). Packing needs:

- float32: oneDNN in the torch build (any x86-64 CPU).
- bfloat16: oneDNN *and* a CPU with AVX-512 (bw, vl, dq) or AVX-NE-CONVERT. On AVX2-only CPUs
  oneDNN refuses bf16 weights; there the prefill keeps ``F.linear`` (PyTorch's bf16 GEMV, HF's
  kernel) and every other pass, one-token steps and blocks alike (whose rows must round alike),
  goes through float32 oneDNN-packed copies of the bf16 weights (exact upcast, fp32 accumulation,
  rounded back): PyTorch's GEMV would run a block row by row (cost linear in the width).

``SPECULANT_CPU_KERNELS`` (or ``kernels=``) overrides the choice: ``onednn`` (pack, or fail with
one line where the CPU cannot), ``fp32-blocks`` (what bf16 gets without oneDNN bf16: float32 packed
copies of its weights, which the fast path uses for one-token steps and blocks alike, one kernel for
every pass; the plan still names a step kernel for callers that split them; any CPU with oneDNN), ``aten`` (plain
``F.linear`` everywhere). Tests force each on every machine, so no branch goes untested on any ISA.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from ..errors import SpeculantError

KERNEL_CHOICES = ("auto", "core", "onednn", "fp32-blocks", "aten")
ENV = "SPECULANT_CPU_KERNELS"


def cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def machine_key() -> str:
    """What decides which kernels run and how they round: the CPU, its ISA level, torch, threads and
    the kernel choice asked for."""
    return "|".join([cpu_key(), str(torch.get_num_threads()), os.environ.get(ENV, "auto"),
                     os.environ.get("SPECULANT_CPU_ISA", "native")])


def cpu_key() -> str:
    """The CPU model, its ISA level and torch: what a kernel compiled for this machine depends on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return "|".join([cpu, cpu_capability(), torch.__version__])


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack (and multiply with) weights of this dtype on this CPU.

    The capability answers for AVX-512 CPUs; elsewhere (AVX2, with or without AVX-NE-CONVERT, and
    non-x86 CPUs) a 16x16 pack-and-multiply is tried once."""
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
    except (AttributeError, RuntimeError):
        return False
    if dtype == torch.bfloat16 and cpu_capability().startswith("AVX512"):
        return True  # ATen's AVX512 level implies avx512f/bw/vl/dq, which oneDNN's bf16 path needs
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 1)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), w, None, "none", [], "")
        return bool(y.float().sum() == 256)
    except RuntimeError:
        return False


class PackedLinear:
    """A CPU weight reordered once into oneDNN's blocked layout (a second copy of it).

    ``compute``: the dtype oneDNN multiplies in (the weight's own by default). A bf16 weight packed
    as float32 computes on the exact upcast and returns bf16 (for CPUs without oneDNN bf16).
    ``hint``: the batch size oneDNN picks its blocking for; 1 keeps bf16 results the same bits as
    ``F.linear`` (tested), 8 serves the 1-16 token blocks of decoding best in float32 (measured).
    Which numbers of rows a call may hold so that each row's bits stay its own: ``invariant``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, compute: torch.dtype | None = None,
                 hint: int = 1):
        self.out_dtype = weight.dtype
        self.compute = compute or weight.dtype
        self.out_features, self.in_features = weight.shape
        w = weight.detach().to(self.compute).contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, hint)
        self.bias = None if bias is None else bias.detach().to(self.compute).contiguous()

    @classmethod
    def stacked(cls, weights: list[torch.Tensor], biases: list[torch.Tensor | None], compute: torch.dtype | None = None,
                hint: int = 1) -> "PackedLinear":
        """One packed matmul for several that read the same input (q/k/v, gate/up): the weights
        stacked by rows, their outputs side by side (a missing bias is zeros)."""
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        return cls(torch.cat(weights) if len(weights) > 1 else weights[0], bias, compute, hint)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute == self.out_dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.compute), self.weight, self.bias, "none", [], "")
        return y.to(self.out_dtype)


@functools.cache
def stacking_is_exact(dtype: torch.dtype, in_features: int, outs: tuple[int, ...], bias: bool, hint: int) -> bool:
    """Whether one packed matmul over stacked weights gives each part the very bits ``F.linear``
    gives it alone, for this shape on this CPU. Each output is one dot product over the same
    inputs, but a kernel may block its sums otherwise for a wider output; checked once per shape
    on random values (rows 1-16: one-token steps of a batch), where such a difference shows."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, in_features, generator=g).to(dtype) for o in outs]
    biases = [torch.randn(o, generator=g).to(dtype) if bias else None for o in outs]
    fused = PackedLinear.stacked(weights, biases, dtype, hint)
    for rows in (1, 2, 4, 9, 16):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        want = torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)], -1)
        if not torch.equal(fused(x), want):
            return False
    return True


@dataclass(frozen=True)
class KernelPlan:
    """How one-token steps and wider blocks multiply. ``*_pack``: the dtype packed copies compute
    in (None: ``F.linear`` over the model's own weights)."""

    name: str  # reported in stats as "cpu_kernels"
    step_pack: torch.dtype | None
    block_pack: torch.dtype | None
    hint: int = 1


def requested(kernels: str | None) -> str:
    choice = kernels or os.environ.get(ENV) or "auto"
    if choice not in KERNEL_CHOICES:
        raise SpeculantError(f"unknown CPU kernel choice {choice!r} ({ENV} or kernels=): use one of "
                             f"{', '.join(KERNEL_CHOICES)}")
    return choice


def plan(dtype: torch.dtype, weight_bytes: int, kernels: str | None = None) -> KernelPlan:
    """The kernels for a model of this dtype and size on this CPU (``core``, the kernel core's, is
    ``fast.choose_kernels``' choice for float32 models: "auto" here)."""
    choice = requested(kernels)
    if choice == "core":
        choice = "auto"
    if choice == "aten":
        return KernelPlan("aten (F.linear)", None, None)
    f32 = onednn_packs(torch.float32)
    fp32_blocks = KernelPlan("aten steps + onednn-packed fp32 blocks", None, torch.float32, hint=8)
    if choice == "fp32-blocks" and f32:
        return fp32_blocks
    if dtype == torch.float32 and f32:
        want = KernelPlan("onednn-packed fp32", torch.float32, torch.float32, hint=8)
        extra = weight_bytes
    elif dtype == torch.bfloat16 and onednn_packs(torch.bfloat16):
        want = KernelPlan("onednn-packed bf16", torch.bfloat16, torch.bfloat16, hint=1)
        extra = weight_bytes
    elif dtype == torch.bfloat16 and f32:
        want = KernelPlan(f"{fp32_blocks.name} (no oneDNN bf16 on {cpu_capability()})", None, torch.float32, hint=8)
        extra = 2 * weight_bytes
    else:
        if choice != "auto":
            raise SpeculantError(f"oneDNN cannot pack {str(dtype).removeprefix('torch.')} weights on this CPU "
                                 f"({cpu_capability()}): unset {ENV} or use kernels='auto'")
        return KernelPlan(f"aten (F.linear; no oneDNN packing for {str(dtype).removeprefix('torch.')})", None, None)
    if choice == "auto" and extra > available_bytes() // 4:
        return KernelPlan("aten (F.linear; too little free memory for packed copies)", None, None)
    return want


def available_bytes() -> int:
    try:
        return int(psutil.virtual_memory().available)
    except Exception:  # unreadable /proc: assume plenty
        return 1 << 62


def pack_linears(module: torch.nn.Module, kernels: str | None = None) -> torch.nn.Module:
    """Give every ``nn.Linear`` of a small CPU network (a drafter's) a oneDNN-packed forward, as the
    fast path's verify blocks get: drafters run blocks of a few rows, where ``F.linear`` pays most
    per call. The weights stay where they are (state dicts unchanged); the packed copies are taken
    now, so pack after the weights are final. A no-op on GPU or where nothing can be packed."""
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    if not linears or linears[0].weight.device.type != "cpu":
        return module
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    how = plan(linears[0].weight.dtype, size, kernels)
    if how.block_pack is None:
        return module
    # a module that declares a slot for it (trained.blocks' attention and MLP) gets one matmul for its
    # projections that read the same input (fewer, wider matmuls stream faster); those projections
    # get no packed copy of their own (their forward runs through the slot)
    stacked = set()
    for m in module.modules():
        for slot, names in STACKED.items():
            parts = [getattr(m, n, None) for n in names]
            if hasattr(m, slot) and all(isinstance(p, torch.nn.Linear) for p in parts):
                setattr(m, slot, PackedLinear.stacked([p.weight for p in parts], [p.bias for p in parts],
                                                      how.block_pack, how.hint))
                stacked.update(map(id, parts))
    for m in linears:
        if id(m) not in stacked:
            m.forward = PackedLinear(m.weight, m.bias, how.block_pack, how.hint)
    return module


STACKED = {"stacked_qkv": ("q_proj", "k_proj", "v_proj"), "stacked_gate_up": ("gate_proj", "up_proj")}

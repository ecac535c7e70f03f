"""The CPU's width-invariant attention kernel (csrc/attention.cpp), built once per machine.

Each query is computed alone over exactly its own keys in text order, with sums whose order
depends on nothing else, so the kernel is width-invariant by construction (no check needed), and
one call serves a one-token step, a verify block, a token tree and a batch alike. It is compiled
with this machine's compiler the first time it is needed (about a minute on 2 cores; PyTorch keeps
the build under its extensions folder), and ``invariant.attention_choice`` falls back to attention
in PyTorch ops, checked per machine, where no compiler is at hand or ``SPECULANT_CPU_ATTENTION=torch``.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

from .cpu_kernels import machine_key

ENV = "SPECULANT_CPU_ATTENTION"
# -march=native: this CPU's vectors and fused multiply-adds. Every sum of the kernel is written on
# whole vectors (no scalar remainder a compiler could round otherwise), so each query runs the same
# instructions wherever it sits. OpenMP: at::parallel_for's threads.
FLAGS = ["-O3", "-march=native", "-fopenmp"]
SOURCE = Path(__file__).parent / "csrc" / "attention.cpp"


@functools.cache
def kernel():
    """The compiled ``attend`` function, or None (no compiler, a failed build, or turned off)."""
    if os.environ.get(ENV, "auto") == "torch":
        return None
    try:
        from torch.utils import cpp_extension  # a fifth of a second to import: only to build the kernel

        source = SOURCE.read_text()
        # the build uses this CPU's instructions (-march=native): named per CPU, so a home folder shared
        # by machines of other CPUs never loads one built elsewhere
        tag = hashlib.sha256((source + " ".join(FLAGS) + machine_key()).encode()).hexdigest()[:12]
        name = f"speculant_attention_{tag}"
        if not list(Path(cpp_extension.get_default_build_root()).glob(f"*/{name}/{name}.so")):
            print("speculant: building the CPU attention kernel for this machine (once, about a minute)",
                  file=sys.stderr, flush=True)
        module = cpp_extension.load_inline(name, [source], functions=["attend"], extra_cflags=FLAGS,
                                           extra_ldflags=["-fopenmp"], verbose=False)
        return module.attend
    except Exception as e:  # no compiler or ninja, or a failed build: attention in PyTorch ops instead
        print(f"speculant: no compiled CPU attention kernel ({str(e).splitlines()[0][:120]}); "
              f"using attention in PyTorch ops", file=sys.stderr, flush=True)
        return None


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor | None,
           count: torch.Tensor, scale: float) -> torch.Tensor:
    fn = kernel()
    empty = torch.empty(0, 0, 0, dtype=torch.long)
    return fn(q, keys, values, empty if slots is None else slots, count, scale)

"""The CPU's width-invariant attention kernel (csrc/core/attention.h), built once per machine in the
one module of every CPU kernel (``native``).

Each query is computed alone over exactly its own keys in text order, with sums whose order
depends on nothing else, so the kernel is width-invariant by construction (no check needed), and
one call serves a one-token step, a verify block, a token tree and a batch alike. It is compiled
with this machine's compiler the first time it is needed (about a minute on 2 cores; PyTorch keeps
the build under its extensions folder), and ``invariant.attention_choice`` falls back to attention
in PyTorch ops, checked per machine, where no compiler is at hand or ``SPECULANT_CPU_ATTENTION=torch``.
"""
from __future__ import annotations

import functools
import os

import torch

from . import native

ENV = "SPECULANT_CPU_ATTENTION"
LANES = 16  # the kernel's head dims are whole multiples of this (head dims between are padded)


@functools.cache
def kernel():
    """The compiled ``attend`` function, or None (no compiler, a failed build, or turned off)."""
    if os.environ.get(ENV, "auto") == "torch":
        return None
    module = native.build()
    return None if module is None else module.attend


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor | None,
           count: torch.Tensor, scale: float) -> torch.Tensor:
    fn = kernel()
    empty = torch.empty(0, 0, 0, dtype=torch.long)
    D = q.shape[-1]
    pad = -D % LANES
    if pad:  # the kernel reads whole 16-float rows: zeros add nothing to a score and come out as zeros
        q, keys, values = (torch.nn.functional.pad(x, (0, pad)) for x in (q, keys, values))
    out = fn(q, keys, values, empty if slots is None else slots, count, scale)
    return out[..., :D] if pad else out

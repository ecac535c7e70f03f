"""``speculant.load(...)`` -> Generator: a target and a drafter from their names, with ``--dtype auto``
measured on a CPU (``cpu_choice``, which runs a Generator: so this sits above ``api``)."""
from __future__ import annotations

from ..api import Generator, check_gamma
from ..drafters import Drafter, default_drafter, make_drafter, validate_drafter_spec
from ..errors import SpeculantError
from ..models.backend import PATHS
from ..models import native
from ..models.loading import load_model, resolve_device, resolve_model_path
from .cpu_choice import choose as choose_cpu_dtype


def load(target: str = "default", drafter: str | Drafter | None = None, gamma: int | str | None = None,
         device: str | None = None, dtype: str | None = None, path: str = "auto", compile: bool = False,
         device_map: str | dict | None = None) -> Generator:
    """Load a target ("default" | model folder | .gguf) and a drafter (see drafters.DRAFTER_HELP; None:
    the trained drafter shipped for the target, if one ships, else "ngram").

    dtype: "auto" (default): bfloat16 on CUDA; on a CPU the dtype and path that measure fastest on
    this machine with this drafter among the exact ones (tools/cpu_choice.py: measured once, cached).
    path: "auto" (the static-cache fast path where the architecture has one), "fast" or "general".
    compile: torch.compile the fast path's forward (worth it for long runs; compiling takes a while).
    device_map: "auto" spreads a target too big for one GPU over the GPUs with accelerate (the
    general path then runs it; the drafter goes where the target's embeddings are).
    """
    if path not in PATHS:
        raise SpeculantError(f"unknown path {path!r}: use one of {', '.join(PATHS)}")
    if gamma is not None:
        check_gamma(gamma)
    resolve_model_path(target)  # a FIFO, a device or a name too long: one line now, before any measuring
    if drafter is not None:
        validate_drafter_spec(drafter)  # bad input fails before any model work
    dev = resolve_device(device)
    if dev.type == "cpu":
        native.start_building()  # the CPU fast path's kernels (attention; quantized weights): built while the target loads
    choice = None
    if dev.type == "cpu" and dtype in (None, "", "auto") and device_map is None:
        # timed with the drafter that will run (an object given here cannot be rebuilt per dtype: plain decoding)
        choice = choose_cpu_dtype(target, drafter if drafter is None or isinstance(drafter, str) else "none")
        dtype = choice.dtype
    tgt = load_model(target, device=dev, dtype=dtype, device_map=device_map)
    d = make_drafter(drafter if drafter is not None else default_drafter(tgt), tgt)
    gen = Generator(tgt, d, gamma, path, compile)
    gen.backend.info()  # its first call proves the kernels' width invariance (~0.3 s on a CPU): now, not in a request
    if choice is not None:
        gen.backend.dtype_choice = choice.describe()
    return gen

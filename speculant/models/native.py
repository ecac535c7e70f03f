"""The C++ kernels in ``csrc/``, compiled once per machine with this machine's compiler.

``csrc/core/`` is the kernel core, plain C++ with no PyTorch in it (per-ISA primitives in
``core/arch/``: AVX-512, AVX2, NEON, plain C++), and ``csrc/kernels.cpp`` its thin PyTorch binding:
one module holds every CPU kernel (attention, quantized linears, a decoder layer). It is built with
``-march=native`` (this CPU's vectors and fused multiply-adds, which pick the ISA branch),
``-ffp-contract=off`` (every multiply-add the code does not ask to fuse stays two IEEE operations,
so every ISA branch gives the same bits) and OpenMP (at::parallel_for's threads). PyTorch keeps
the build under its extensions folder, named per source, flags and CPU, so a home folder shared by
machines of other CPUs never loads one built elsewhere. Where no compiler is at hand, or a build
fails, ``build`` says so once and returns None: the callers fall back to PyTorch ops.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import time
from pathlib import Path

from .. import sampling, verify
from .cpu_kernels import cpu_key

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
CSRC = Path(__file__).parent / "csrc"
FUNCTIONS = ("attend", "quant_linear", "layer_start", "layer_end", "layer", "bind_layers", "unbind_layers", "run_layers",
             "bind_ends", "run_pass",
             "eagle_layer", "eagle_chain", "chain_tree", "norm", "argmax", "tree_layout", "greedy_accept", "move_slots", "group_size",
             "q8_quantize", "isa")
STALE_LOCK_S = 600  # a build takes about a minute, writing files as it goes: ten quiet minutes is a killed one


def _clear_stale_lock(folder: Path) -> None:
    """PyTorch's build lock outlives a process killed mid-build, and the next build would wait on it
    forever: a lock in a folder where nothing (no object file, no ninja log) has been written for
    longer than a build takes is removed."""
    lock = folder / "lock"
    try:
        if not lock.exists():
            return
        newest = max(f.stat().st_mtime for f in folder.iterdir())
        if time.time() - newest > STALE_LOCK_S:
            lock.unlink()
            print(f"speculant: removed a stale build lock ({lock})", file=sys.stderr, flush=True)
    except OSError:  # gone meanwhile (a build finished), or not ours to remove: PyTorch waits or fails as it would
        pass


def _await_other_build(folder: Path, poll_s: float = 1.0) -> None:
    """Wait here while another process's build holds the folder's lock, saying so once; a lock
    that goes stale meanwhile (a build killed just before this one started) is removed. PyTorch's
    own wait on it has no end: a run started right after a killed build waited silently forever."""
    lock, said = folder / "lock", False
    while True:
        _clear_stale_lock(folder)
        if not lock.exists():
            return
        if not said:
            print(f"speculant: waiting for another build of the CPU kernels ({lock}; removed if nothing is written "
                  f"there for {STALE_LOCK_S // 60} minutes)", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_s)


def sources() -> str:
    """Every file of csrc/ (the binding includes the core's headers): a change to any rebuilds."""
    files = sorted(f for f in CSRC.rglob("*") if f.suffix in (".cpp", ".h") and "harness" not in f.parts)
    return "".join(f"{f.relative_to(CSRC)}\n{f.read_text()}" for f in files)


# "-mno-<feature>" flags that change nothing on a CPU without the feature (cpuinfo's name for it)
_TURNS_OFF = {"-mno-avx512f": "avx512f", "-mno-avx2": "avx2", "-mno-avx512vnni": "avx512_vnni", "-mno-amx-tile": "amx_tile",
              "-mno-amx-int8": "amx_int8"}


def _cpuinfo(*keys: str) -> str:
    """The value of the first /proc/cpuinfo line starting with one of ``keys`` ('' where none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags", "Features").split())


def _vendor_flags() -> tuple[str, ...]:
    """Defines for what differs by CPU vendor and changes no bits: q8's prefetch (csrc/core/q8.h)."""
    return ("-DSPK_CPU_INTEL",) if _cpuinfo("vendor_id") == "GenuineIntel" else ()


# $SPECULANT_CPU_ISA: build an older ISA's branch on this CPU (benchmarks of the AVX2 class on an
# AVX-512 machine; the tests force each branch themselves)
ISA_ENV = "SPECULANT_CPU_ISA"
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "generic": ("-mno-avx512f", "-mno-avx2")}
_BUILDING = threading.Lock()  # one build at a time in this process (``start_building``'s thread, the caller)


def build(isa: tuple[str, ...] = ()):
    """The compiled kernels module (``csrc/kernels.cpp``), or None (no compiler, a failed build).
    ``isa``: flags on top of ``-march=native`` (``-mno-avx512f``: the AVX2 branch, which the tests
    build on any x86 CPU); one that turns off a feature this CPU lacks is dropped (the same build)."""
    flags = build_flags(isa)
    with _BUILDING:
        return _build(flags)


def build_flags(isa: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The flags ``build`` adds to FLAGS: this CPU's vendor's defines, ``$SPECULANT_CPU_ISA``'s and
    ``isa``, less those that turn off a feature this CPU lacks."""
    have = _cpu_flags()
    forced = os.environ.get(ISA_ENV, "native")
    if forced not in ISA_FLAGS:
        print(f"speculant: ${ISA_ENV}={forced!r} is not one of {', '.join(ISA_FLAGS)}: ignored", file=sys.stderr)
        forced = "native"
    flags = tuple(dict.fromkeys(_vendor_flags() + ISA_FLAGS[forced] + isa))
    return tuple(f for f in flags if f not in _TURNS_OFF or _TURNS_OFF[f] in have)


def start_building() -> None:
    """Build this machine's kernels in a thread now (a no-op once built): the first load of a GGUF
    dequantises it meanwhile, so a first run waits for the longer of the two, not their sum."""
    threading.Thread(target=build, name="speculant-kernels-build", daemon=True).start()


_built = None  # the first kernels module this process built (``built``)


def built():
    """The kernels this process has built already, or None: never starts a build (for a caller on a
    path that runs without them, e.g. moving a token tree's K/V in one call where they exist)."""
    return _built


@functools.cache
def _build(isa: tuple[str, ...]):
    try:
        from torch.utils import cpp_extension  # a fifth of a second to import: only to build a kernel

        all_flags = list(FLAGS + isa)
        tag = hashlib.sha256((sources() + " ".join(all_flags) + cpu_key()).encode()).hexdigest()[:12]
        name = f"speculant_kernels_{tag}"
        # PyTorch builds in $TORCH_EXTENSIONS_DIR/<name>, else in <default root>/<python, cuda>/<name>
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
        folders = [*root.glob(name), *root.glob(f"*/{name}")]
        for folder in folders:
            _await_other_build(folder)
        if not any((folder / f"{name}.so").exists() for folder in folders):
            print("speculant: building the CPU kernels for this machine (once, about a minute)", file=sys.stderr,
                  flush=True)
        module = cpp_extension.load_inline(name, [(CSRC / "kernels.cpp").read_text()], functions=list(FUNCTIONS),
                                           extra_cflags=all_flags, extra_ldflags=["-fopenmp"],
                                           extra_include_paths=[str(CSRC)], verbose=False)
        sampling.use_compiled_argmax(module.argmax)  # greedy decoding's (any ISA's build: the same indices)
        verify.use_compiled_greedy_accept(module.greedy_accept)
        global _built
        _built = _built or module
        return module
    except Exception as e:  # no compiler or ninja, or a failed build
        print(f"speculant: could not build the CPU kernels ({str(e).splitlines()[0][:120]}); using PyTorch ops",
              file=sys.stderr, flush=True)
        return None

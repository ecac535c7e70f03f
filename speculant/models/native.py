"""The C++ kernels in ``csrc/``, compiled once per machine with this machine's compiler.

``csrc/core/`` is the kernel core, plain C++ with no PyTorch in it (per-ISA primitives in
``core/arch/``: AVX-512, AVX2, NEON, plain C++), and ``csrc/kernels.cpp`` its thin PyTorch binding:
one module holds every CPU kernel (attention, quantized linears, a decoder layer). It is built with
``-march=native`` (this CPU's vectors and fused multiply-adds, which pick the ISA branch),
``-ffp-contract=off`` (every multiply-add the code does not ask to fuse stays two IEEE operations,
so every ISA branch gives the same bits) and OpenMP (at::parallel_for's threads). PyTorch keeps
the build under its extensions folder, named per source, flags, CPU and toolchain (``module_name``), so
a home folder shared by machines of other CPUs never loads one built elsewhere, and builds of other
configurations sit side by side instead of replacing one another. Where no compiler is at hand, or a build
fails, ``build`` says so once and returns None: the callers fall back to PyTorch ops.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import sampling, verify
from .cpu_kernels import cpu_key

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)
CSRC = Path(__file__).parent / "csrc"
FUNCTIONS = ("attend", "quant_linear", "layer_start", "layer_end", "layer", "bind_layers", "unbind_layers", "run_layers",
             "bind_ends", "run_pass",
             "eagle_layer", "eagle_chain", "chain_tree", "norm", "argmax", "tree_layout", "greedy_accept", "move_slots", "group_size",
             "q8_quantize", "gguf_pack", "gguf_kind", "gguf_group_bytes", "q8_dequantize", "isa")


@contextlib.contextmanager
def build_lock(root: Path, name: str, say=lambda msg: print(msg, file=sys.stderr, flush=True)):
    """One build of a kernels module at a time across processes: an flock on a file beside the build
    folders, which the OS lets go of the moment its holder exits, however it exits, so a killed build
    never blocks the next. While it is held, a PyTorch build lock in the module's folder is a killed
    build's (every build here takes this lock first), and goes at once: PyTorch's own wait on it has
    no end."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): PyTorch's lock alone
        yield
        return
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "a+") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            say(f"speculant: waiting for another process's build of the CPU kernels ({root / name})")
            fcntl.flock(held, fcntl.LOCK_EX)
        try:
            for folder in [*root.glob(name), *root.glob(f"*/{name}")]:
                stale = folder / "lock"
                if stale.exists():
                    stale.unlink(missing_ok=True)
                    say(f"speculant: removed a killed build's lock ({stale})")
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


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


@functools.cache
def _compiler_version(cxx: str) -> str:
    """``cxx --version``'s first line ('' where it does not answer)."""
    try:
        said = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, ValueError, subprocess.SubprocessError):
        return ""
    return (said.splitlines() or [""])[0]


def _cpu() -> str:
    """The CPU ``-march=native`` compiles for: its model and feature flags (two VMs of one model may
    show different ones), or ``cpu_key`` where /proc/cpuinfo is not there."""
    flags = _cpu_flags()
    if not flags:
        return cpu_key()
    return "|".join([platform.machine(), _cpuinfo("model name", "CPU part"), " ".join(sorted(flags))])


def toolchain() -> str:
    """What besides the sources and flags changes the built module: the compiler PyTorch runs
    ($CXX, else c++) and its version, Python's version and headers, torch's version and install."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    cxx = cpp_extension.get_cxx_compiler() if hasattr(cpp_extension, "get_cxx_compiler") else \
        os.environ.get("CXX", "c++")
    return "|".join([cxx, _compiler_version(cxx), sys.version, sysconfig.get_paths()["include"], torch.__version__,
                     str(Path(torch.__file__).parent)])


def module_name(flags, source: str | None = None, prefix: str = "speculant_kernels") -> str:
    """The kernels module's name, keyed by everything its build depends on: the sources (csrc/'s,
    or ``source``), the flags (``$SPECULANT_CPU_ISA``'s and the vendor's defines among them), the CPU,
    the sources' folder, the toolchain. PyTorch builds each name in a folder of its own, so other
    configurations (an ISA forced, another compiler or Python, two installs) sit side by side
    instead of replacing one another's module and rebuilding in turn; the same configuration always
    gets the same name, and loads what it built before."""
    key = "\n".join([sources() if source is None else source, " ".join(flags), " ".join(LDFLAGS), _cpu(),
                     str(CSRC.resolve()), toolchain()])
    return f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


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
        name = module_name(all_flags)  # everything the build depends on is in the name
        # PyTorch builds in $TORCH_EXTENSIONS_DIR/<name>, else in <default root>/<python, cuda>/<name>
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
        with build_lock(root, name):
            if not any((folder / f"{name}.so").exists() for folder in [*root.glob(name), *root.glob(f"*/{name}")]):
                print("speculant: building the CPU kernels for this machine (once, about a minute)", file=sys.stderr,
                      flush=True)
            module = cpp_extension.load_inline(name, [(CSRC / "kernels.cpp").read_text()], functions=list(FUNCTIONS),
                                               extra_cflags=all_flags, extra_ldflags=list(LDFLAGS),
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

"""The C++ kernels in ``csrc/``, compiled once per machine with this machine's compiler.

Each is built with ``-march=native`` (this CPU's vectors and fused multiply-adds) and OpenMP
(at::parallel_for's threads); PyTorch keeps the build under its extensions folder, named per
source, flags and CPU, so a home folder shared by machines of other CPUs never loads one built
elsewhere. Where no compiler is at hand, or a build fails, ``build`` says so once and returns None:
the caller falls back to PyTorch ops.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from pathlib import Path

from .cpu_kernels import cpu_key

FLAGS = ("-O3", "-march=native", "-fopenmp")
CSRC = Path(__file__).parent / "csrc"
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


@functools.cache
def build(stem: str, functions: tuple[str, ...], what: str, flags: tuple[str, ...] = ()):
    """The compiled module of ``csrc/<stem>.cpp`` exposing ``functions``, or None (no compiler, a
    failed build). ``what`` names it in messages ("the CPU attention kernel")."""
    try:
        from torch.utils import cpp_extension  # a fifth of a second to import: only to build a kernel

        source = (CSRC / f"{stem}.cpp").read_text()
        # every file of csrc/ may be included (quantized.cpp includes attention.cpp): a change rebuilds
        others = "".join(f.read_text() for f in sorted(CSRC.iterdir()) if f.suffix in (".cpp", ".h"))
        all_flags = list(FLAGS + flags)
        tag = hashlib.sha256((source + others + " ".join(all_flags) + cpu_key()).encode()).hexdigest()[:12]
        name = f"speculant_{stem}_{tag}"
        # PyTorch builds in $TORCH_EXTENSIONS_DIR/<name>, else in <default root>/<python, cuda>/<name>
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
        folders = [*root.glob(name), *root.glob(f"*/{name}")]
        for folder in folders:
            _clear_stale_lock(folder)
        if not any((folder / f"{name}.so").exists() for folder in folders):
            print(f"speculant: building {what} for this machine (once, about a minute)", file=sys.stderr, flush=True)
        return cpp_extension.load_inline(name, [source], functions=list(functions), extra_cflags=all_flags,
                                         extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
                                         verbose=False)
    except Exception as e:  # no compiler or ninja, or a failed build
        print(f"speculant: could not build {what} ({str(e).splitlines()[0][:120]}); using PyTorch ops",
              file=sys.stderr, flush=True)
        return None

"""What a measurement ran on and what ran: every results file speculant's benchmarks and scripts
write carries ``machine_info()`` (the commit, the CPU's model, ISA level and the instruction-set
flags that decide which kernels run, the GPU, the library versions) and, for each generator it
timed, ``what_ran(gen)`` (the drafter, dtype, path and kernels the run actually used, which
``--dtype auto`` or the kernel checks may have chosen). The results tables in the docs are written
from these files (``speculant.bench.tables``)."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from ..version import __version__

# the /proc/cpuinfo flags that decide which CPU kernels can run (x86: "flags"; ARM: "Features")
X86_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
             "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8")
ARM_FEATURES = ("asimd", "asimddp", "asimdhp", "bf16", "i8mm", "sve", "sve2", "sme")
REPO = Path(__file__).resolve().parents[2]  # the checkout holding this package (if it is one)


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # one processor is enough: they are alike
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("CPU part") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The kernel-relevant instruction-set flags this CPU reports, in a fixed order."""
    info = _cpuinfo()
    have = set((info.get("flags") or info.get("Features") or "").split())
    wanted = ARM_FEATURES if platform.machine().lower() in ("aarch64", "arm64") else X86_FLAGS
    return [f for f in wanted if f in have]


def cpu_class(flags: list[str], machine: str | None = None) -> str:
    """The CPU class results are grouped by (the cpu-<class>-... folder names): AMX, AVX512BF16,
    AVX512, AVX2, else the architecture (an ARM CPU: aarch64, with sve where it has it)."""
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512BF16"
    if "avx512f" in flags:
        return "AVX512"
    if "avx2" in flags:
        return "AVX2"
    arch = (machine or platform.machine()).lower()
    return f"{arch}+sve" if "sve" in flags else arch


def cpu_capability() -> str:
    """PyTorch's own ISA level for its CPU kernels (e.g. AVX2, AVX512, DEFAULT)."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def commit() -> dict:
    """The commit measured: ``git rev-parse HEAD`` of this checkout and whether tracked files differ
    from it; where the code is no checkout (a copy on a GPU machine), ``$SPECULANT_COMMIT`` if set."""
    def git(*args) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is not None and Path(top).resolve() == REPO:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(dirty), "source": "git"}
    given = os.environ.get("SPECULANT_COMMIT")
    return {"commit": given, "dirty": None, "source": "$SPECULANT_COMMIT" if given else "unknown (not a git checkout)"}


def kernels_isa() -> str | None:
    """The ISA branch of speculant's CPU kernels as built here (docs/kernels.md), None without them."""
    from ..models import native

    module = native.build()
    return module.isa() if module is not None else None


def machine_info(device=None) -> dict:
    """The machine and code a run measured. ``device``: where the model ran (default: the CPU)."""
    import transformers  # takes a second to import: only where a model runs (loaded by then)

    flags = cpu_flags()
    info = {
        "cpu": cpu_model(), "cpu_class": cpu_class(flags), "cpu_capability": cpu_capability(), "cpu_flags": flags,
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "arch": platform.machine(),
        "gpu": None, "device": str(device or "cpu"), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "speculant": __version__, "hostname": platform.node(), **commit(),
        "kernels_isa": kernels_isa(), "forced_isa": os.environ.get("SPECULANT_CPU_ISA"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def what_ran(generator) -> dict:
    """What a Generator runs: its drafter as built, and the backend's path, dtype, CPU kernels,
    exactness and (``--dtype auto``) why that dtype."""
    return {"drafter": generator.drafter.describe(), **generator.backend.info()}


def device_label(machine: dict) -> str:
    """The processor the run used: the GPU for a CUDA run, else the CPU."""
    return machine["gpu"] if str(machine.get("device", "")).startswith("cuda") and machine.get("gpu") else machine["cpu"]

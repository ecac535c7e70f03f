"""The kernel core (speculant/models/csrc/core: plain C++, no PyTorch) on every ISA branch.

The core's harness (csrc/harness/harness.cpp) runs every kernel (quantized linears of both
formats and linears over float32 and bfloat16 weights at many widths, the latter checked against
their blocks' and float32 values' bits, attention over chains and trees in float32, bfloat16 and
float16, a whole decoder layer, the norm, EAGLE-3's drafting call and its tree, greedy acceptance)
on inputs it makes itself, checks width invariance, and prints a hash of each output. Built for
each branch, it must print the same lines: the AVX-512 (with and without VNNI; AMX with every q8
width on its tiles where the CPU has it), AVX2 (with an Intel CPU's prefetch hints, the others
with AMD's) and plain C++ branches on any x86 CPU, and the ARM
NEON branch (with and without the dot-product extension) and plain C++ for
aarch64, cross-compiled with Debian's g++-aarch64-linux-gnu and run under qemu-user (``apt-get
install g++-aarch64-linux-gnu qemu-user``; CI installs them, the test skips without).
"""
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from speculant.models import native

HARNESS = native.CSRC / "harness" / "harness.cpp"
COMMON = ["-O2", "-std=c++17", "-ffp-contract=off", f"-I{native.CSRC}"]
# AMX (Intel Xeon since Sapphire Rapids) with every width of q8 on its tiles
X86 = {"avx512-vnni-amx": ["-march=sapphirerapids", "-DSPK_Q8_AMX_FROM_ROWS=1"],
       "avx512-vnni": ["-march=x86-64-v4", "-mavx512vnni"], "avx512": ["-march=x86-64-v4"],
       # the AVX2 build with an Intel CPU's prefetches (q8.h, attention.h: SPK_CPU_INTEL), runnable on any x86
       # machine, so both vendors' branches are built and compared wherever the tests run
       "avx2": ["-march=x86-64-v3", "-DSPK_CPU_INTEL"], "generic": ["-march=x86-64-v3", "-mno-avx2"]}
ARM = {"neon-dotprod": ["-march=armv8.2-a+dotprod"], "neon": ["-march=armv8-a"],
       "generic": ["-march=armv8-a", "-DSPK_FORCE_GENERIC"]}


def _build(compiler: str, flags: list[str], out: Path) -> Path:
    proc = subprocess.run([compiler, *COMMON, *flags, str(HARNESS), "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _run(cmd: list[str]) -> list[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout.splitlines()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.fixture(scope="module")
def x86_outputs(tmp_path_factory):
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        pytest.skip("needs an x86-64 machine with g++")
    have = _cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    runnable = {"avx512-vnni-amx": avx512 | {"avx512_vnni", "amx_tile", "amx_int8", "avx512_bf16", "avx512_fp16"},
                "avx512-vnni": avx512 | {"avx512_vnni"}, "avx512": avx512, "avx2": {"avx2", "fma"}, "generic": set()}
    folder = tmp_path_factory.mktemp("harness")
    outs = {}
    for isa, flags in X86.items():
        if runnable[isa] <= have:
            outs[isa] = _run([str(_build("g++", flags, folder / f"x86-{isa}"))])
    return outs


def test_every_x86_branch_gives_the_same_bits(x86_outputs):
    assert "generic" in x86_outputs
    for isa, lines in x86_outputs.items():
        assert lines[0] == f"isa {isa}", lines[0]  # the branch asked for is the one built
        assert lines[1:] == x86_outputs["generic"][1:], isa
    assert len(x86_outputs["generic"]) > 15
    names = {line.rsplit(" ", 1)[0] for line in x86_outputs["generic"]}
    assert {"layer", "eagle chain mapped tree", "greedy walk"} <= names


def test_the_arm_branches_give_the_x86_bits_under_qemu(tmp_path, x86_outputs):
    compiler, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if compiler is None or qemu is None:
        pytest.skip("needs g++-aarch64-linux-gnu and qemu-user (apt-get install g++-aarch64-linux-gnu qemu-user)")
    for isa, flags in ARM.items():
        lines = _run([qemu, "-cpu", "max", str(_build(compiler, [*flags, "-static"], tmp_path / f"arm-{isa}"))])
        assert lines[0] == "isa " + isa, lines[0]
        assert lines[1:] == x86_outputs["generic"][1:], isa

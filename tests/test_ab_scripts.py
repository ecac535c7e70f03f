"""scripts/ab_common.py: a side-by-side script's switch between this tree's CPU kernels and a base
revision's reaches every kernel the model calls (both the linears' and attention's lookups keep
the module they got)."""
import sys
from pathlib import Path
from types import SimpleNamespace

from speculant.models import cpu_attention, native, quantized

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ab_common import Kernels  # noqa: E402


def test_switching_kernels_reaches_the_linears_and_attention():
    kernels = Kernels(None)
    if kernels.own is None:
        import pytest
        pytest.skip("no compiler: the kernels do not build here")
    base = SimpleNamespace(attend=object())  # stands in for a base revision's module
    kernels.base = base
    try:
        assert quantized.kernels() is kernels.own  # asked (and kept) before any switch
        kernels.use(True)
        assert quantized.kernels() is base and cpu_attention.kernel() is base.attend
        kernels.use(False)
        assert quantized.kernels() is kernels.own and cpu_attention.kernel() is kernels.own.attend
    finally:
        native.build = kernels.build
        quantized.kernels.cache_clear()
        cpu_attention.kernel.cache_clear()

"""scripts/ab_common.py: a side-by-side script's switch between this tree's CPU kernels and a base
revision's reaches every kernel the model calls (both the linears' and attention's lookups keep
the module they got); drafting_ab.py's bootstrap intervals; prefill_share.py's needed speedup."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from speculant.models import cpu_attention, native, quantized

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ab_common import Kernels  # noqa: E402


def test_switching_kernels_reaches_the_linears_and_attention():
    kernels = Kernels(None)
    if kernels.own is None:
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


def test_drafting_ab_intervals_cover_the_ratio_and_shrink_to_it_without_spread():
    """drafting_ab's bootstrap intervals over the prompts: a method exactly 1.2x its base on every
    prompt gets [1.2, 1.2]; with prompts that differ, an interval around the pooled ratio per
    category and overall."""
    import random

    from drafting_ab import intervals

    even = {(m, c, i): [64, 0.4 / (1.2 if m == "x" else 1.0)] for m in ("none", "x") for c in "ab" for i in range(6)}
    per, overall = intervals(even, "x", "none", ["a", "b"], draws=200)
    assert all(lo == pytest.approx(1.2) and hi == pytest.approx(1.2) for lo, hi in [*per.values(), overall])
    rng = random.Random(0)
    spread = {}
    for c, speedup in (("a", 0.9), ("b", 1.5)):
        for i in range(12):
            base = 0.3 + 0.2 * rng.random()
            spread[("none", c, i)] = [64, base]
            spread[("x", c, i)] = [64, base / (speedup * (0.8 + 0.4 * rng.random()))]
    per, overall = intervals(spread, "x", "none", ["a", "b"], draws=500)
    for c, speedup in (("a", 0.9), ("b", 1.5)):
        lo, hi = per[c]
        assert lo < hi and lo < speedup * 1.2 and hi > speedup * 0.8
    assert per["a"][1] < overall[0] < overall[1] < per["b"][0]  # all lies between the categories


def test_prefill_share_needs_the_decoding_speedup_that_gives_the_target():
    from prefill_share import needed

    for share, target in ((0.2, 1.3), (0.33, 1.3), (0.0, 1.3), (0.5, 1.5)):
        s = needed(share, target)
        assert 1 / (share + (1 - share) / s) == pytest.approx(target)
    assert needed(0.0, 1.3) == pytest.approx(1.3)  # no prefill: the decoding's own speedup
    assert needed(0.8, 1.3) is None  # a prefill of 80 % caps any method at 1.25x


def test_a_base_revision_is_built_with_the_flags_and_defines_of_this_trees_build(monkeypatch):
    """A base build without this CPU vendor's defines (q8's prefetch on Intel) ran 2.4x slower than
    the same code built by ``native.build``: an A/B of nothing."""
    import ab_common
    from torch.utils import cpp_extension

    built = {}
    monkeypatch.setattr(native, "_vendor_flags", lambda: ("-DSPK_CPU_INTEL",))
    monkeypatch.setattr(cpp_extension, "load_inline", lambda name, sources, **kw: built.update(kw) or "module")
    assert ab_common.base_kernels("HEAD") == "module"
    assert built["extra_cflags"] == [*native.FLAGS, *native.build_flags()]
    assert "-DSPK_CPU_INTEL" in built["extra_cflags"]

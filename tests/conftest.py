import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# the CPU attention kernel is compiled once per machine (about a minute): before any test runs, so
# that no test's output holds the notice
from speculant.models import cpu_attention  # noqa: E402

cpu_attention.kernel()


@pytest.fixture(scope="session")
def default_model():
    """The real default target (SmolLM2-135M-Instruct), loaded once per test session."""
    from speculant.models.loading import load_model

    return load_model("default", device="cpu")


@pytest.fixture
def float32_drafts(monkeypatch):
    """Draft networks beside a float32 target stay float32 (``SPECULANT_CPU_KERNELS=onednn``), where
    they would run on the int8 kernels beside a target on the kernel core (quantized.drafts_on_kernels):
    for the tests comparing a network's drafts with a reference's float32 modules, or counting its
    Python forwards."""
    from speculant.models import cpu_kernels

    monkeypatch.setenv(cpu_kernels.ENV, "onednn")


@pytest.fixture(autouse=True)
def _no_dtype_measurement(request, monkeypatch):
    """dtype "auto" on a CPU measures float32 against bfloat16 once per machine and model; tests pin
    it to float32 (deterministic references, no seconds spent measuring tiny models), except the
    tests of that choice itself (tests/test_cpu_choice.py)."""
    if request.module.__name__.endswith("test_cpu_choice"):
        return
    from speculant.tools import cpu_choice

    def pinned(spec, drafter="none", rounds=2, log=None):
        return cpu_choice.Choice("float32", cpu_choice.best_path(spec), {"float32": 0.0})

    monkeypatch.setattr(cpu_choice, "measure", pinned)
    monkeypatch.setattr(cpu_choice, "_cache_file", lambda: cpu_choice.cache_dir() / "cpu-choice-tests.json")

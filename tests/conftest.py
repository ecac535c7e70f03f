import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model():
    """The real default target (SmolLM2-135M-Instruct), loaded once per test session."""
    from speculant.models.loading import load_model

    return load_model("default", device="cpu")

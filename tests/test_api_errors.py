"""The Python API answers bad input with one SpeculantError line, never a traceback from inside."""
import pytest
import torch

import speculant
from speculant.drafters.base import Drafter, Proposal
from speculant.errors import SpeculantError
from helpers import tiny_llama


@pytest.mark.parametrize("args,kwargs,message", [
    (([],), {}, "no prompts given"),
    (([[1, 2], []],), {}, "the prompt is empty"),
    (([1, 2, 999],), {}, "token ids must be integers in 0..95"),
    (([1, 2, 3],), {"top_p": "0.9"}, "top-p must be a number"),
    (([1, 2, 3],), {"temperature": -1.0}, "temperature must be >= 0"),
    (([1, 2, 3],), {"top_k": 2.5}, "top-k must be an integer"),
    (([1, 2, 3],), {"gamma": 0}, "gamma"),
    (([1, 2, 3],), {"seed": "7", "temperature": 1.0}, "seed must be an integer"),
    (([[1, 2], [3, 4]],), {"seed": [1], "temperature": 1.0}, "one per prompt"),
    (([[1, 2], [3, 4]],), {"row_sampling": [{}, "hot"]}, "row_sampling must be a list of 2 dicts"),
    (([1, 2, 3],), {"row_sampling": [{"temprature": 1.0}]}, "unknown sampling setting"),
])
def test_bad_generate_arguments(args, kwargs, message):
    with pytest.raises(SpeculantError, match=message):
        speculant.generate(tiny_llama(0), *args, max_new_tokens=3, **kwargs)


class Malformed(Drafter):
    name = "malformed"

    def __init__(self, how):
        self.how = how

    def start(self, ctx):
        self.ctx = ctx

    def update(self, new_tokens, n_accepted):
        pass

    def select(self, rows):
        pass

    def propose(self, gamma):
        B = len(self.ctx.prompts)
        tokens = torch.zeros(B, gamma, dtype=torch.long)
        lengths = torch.full((B,), gamma)
        if self.how == "too long":
            return Proposal(torch.zeros(B, gamma + 2, dtype=torch.long), lengths + 2)
        if self.how == "bad length":
            return Proposal(tokens, lengths + 5)
        if self.how == "out of vocabulary":
            return Proposal(tokens + 500, lengths)
        return Proposal(tokens, lengths, torch.zeros(B, gamma, 7))  # q of the wrong width


@pytest.mark.parametrize("how,message", [("too long", "draft tokens of shape"), ("bad length", "lengths"),
                                         ("out of vocabulary", "outside the vocabulary"), ("bad q", "q of shape")])
def test_a_custom_drafters_malformed_proposal_is_one_line(how, message):
    with pytest.raises(SpeculantError, match=message):
        speculant.generate(tiny_llama(0), [1, 2, 3, 4], drafter=Malformed(how), gamma=3, max_new_tokens=8)


def test_import_leaves_the_hosts_hub_settings_alone():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = "import os, speculant; print(os.environ.get('HF_HUB_OFFLINE'), os.environ.get('TRANSFORMERS_OFFLINE'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None None"

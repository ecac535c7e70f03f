"""The Python API answers bad input with one SpeculantError line, never a traceback from inside."""
import pytest
import torch

import speculant
from speculant.drafters.base import Drafter, ListedChains, Proposal
from speculant.errors import SpeculantError
from helpers import save_tiny_folder, tiny_llama


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
    (([1, 2, 3],), {"gamma": 1_000_000}, r"gamma .* in 1\.\.64"),
    (([1, 2, 3],), {"logprobs": 10**6}, r"logprobs .* in 0\.\.20"),
    (([1, 2, 3],), {"stop": 123}, "stop must be a string or a list of strings"),
    (([1, 2, 3],), {"stop": ["x"] * 100}, "at most 16"),
    (([1, 2, 3],), {"stop": "x"}, "stop strings need the model's tokenizer"),
    (([1, 2, 3],), {"top_k": 1000}, r"top-k must be in 0\.\.96"),
    (("hello",), {}, "input_ids must be token ids"),
    ((torch.rand(3),), {}, "1-D or 2-D tensor of token ids"),
    (([[1, 2], 3],), {}, "each a list of token ids"),
])
def test_bad_generate_arguments(args, kwargs, message):
    with pytest.raises(SpeculantError, match=message):
        speculant.generate(tiny_llama(0), *args, max_new_tokens=3, **kwargs)


def test_a_model_that_is_not_a_model():
    with pytest.raises(SpeculantError, match="model must be a loaded transformers model"):
        speculant.generate(None, [1, 2])


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    folder = save_tiny_folder(tmp_path_factory.mktemp("api") / "tiny", vocab=96)
    return speculant.load(str(folder), drafter="ngram", device="cpu", dtype="float32")


@pytest.mark.parametrize("call, message", [
    (lambda g: g.generate(None), "the prompt must be text: a str or a list of str, got NoneType"),
    (lambda g: g.generate(123), "got int"),
    (lambda g: g.generate(b"w5 w6"), "got bytes"),
    (lambda g: g.generate([5, 6]), "got a list of int"),
    (lambda g: g.generate("w5", stop=123), "stop must be a string or a list of strings, got int"),
    (lambda g: g.generate("w5", logprobs=10**6), r"logprobs .* in 0\.\.20"),
    (lambda g: g.generate("w5", gamma=10**6), r"in 1\.\.64"),
    (lambda g: g.generate("w5 \ud800"), "lone surrogate"),
    (lambda g: g.generate_ids(123), "prompt ids must be a list of prompts"),
    (lambda g: g.generate_ids([[99999]]), "token ids must be integers in 0..95"),
    (lambda g: g.stream("w5", stop=5).__next__(), "stop must be"),
])
def test_bad_generator_arguments(gen, call, message):
    with pytest.raises(SpeculantError, match=message):
        call(gen)


def test_a_stop_string_is_one_stop_string(gen):
    """A string is one stop string (the server's reading), not a list of its characters."""
    ids = gen.tokenizer("w5 w6 w7 w5 w6 w7")["input_ids"]
    full = gen.generate_ids([ids], max_new_tokens=12)[0]
    words = full.text.split()
    assert len(words) >= 4
    stop = " ".join(words[2:4])  # two words and the space between: stops at them, not at the first space
    for out in (gen.generate_ids([ids], max_new_tokens=12, stop=stop)[0],
                gen.generate("w5 w6 w7 w5 w6 w7", max_new_tokens=12, stop=stop, chat_template=False)):
        assert out.text == full.text[: full.text.index(stop)], (out.text, stop)
    streamed = "".join(gen.stream("w5 w6 w7 w5 w6 w7", max_new_tokens=12, stop=stop, chat_template=False))
    assert streamed == full.text[: full.text.index(stop)]


def test_a_request_beyond_the_memory_budget_is_refused_before_it_starts(gen):
    need = gen.memory_needed(4, 3, 100, "auto")
    assert need > gen.memory_needed(1, 3, 100, "auto") > 0
    budget = gen.memory_budget
    try:
        gen.memory_budget = need - 1
        with pytest.raises(SpeculantError, match="one request may use here"):
            gen.generate_ids([[5, 6, 7]] * 4, max_new_tokens=100)
        assert gen.generate_ids([[5, 6, 7]], max_new_tokens=100)[0].token_ids
    finally:
        gen.memory_budget = budget


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
        if self.how == "listed out of vocabulary":  # chains held as lists are checked as lists
            return ListedChains([[500] * gamma] * B, gamma, self.ctx.device)
        if self.how == "listed too long":
            return ListedChains([[1] * (gamma + 2)] * B, gamma + 2, self.ctx.device)
        return Proposal(tokens, lengths, torch.zeros(B, gamma, 7))  # q of the wrong width


@pytest.mark.parametrize("how,message", [("too long", "draft tokens of shape"), ("bad length", "lengths"),
                                         ("out of vocabulary", "outside the vocabulary"), ("bad q", "q of shape"),
                                         ("listed out of vocabulary", "outside the vocabulary"),
                                         ("listed too long", "draft tokens of shape")])
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

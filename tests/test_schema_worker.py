"""A JSON schema's parser in a process of its own (speculant.schema_worker, issue 73): the server's
processor gives the in-process parser's masks bit for bit, the engine steps other batches while a
schema's state is computed, the budget and a dead child end the request with the reason, and no
child outlives its request."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import speculant
from speculant import constrain, schema_worker
from speculant.constrain import SchemaProcessor, json_schema_processor
from speculant.drafters import NgramDrafter, NoDrafter
from speculant.engine import WAITING
from speculant.schema_worker import SchemaWorker, drafting, workers

pytestmark = pytest.mark.slow
pytest.importorskip("lmformatenforcer")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "colors": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age"]}
PROMPT = "Describe a cat as a JSON object with its name, age and fur colors."


@pytest.fixture(scope="module")
def plain(default_model):
    return speculant.Generator(default_model, NoDrafter())


@pytest.fixture(scope="module")
def prompt(plain):
    return plain.encode(PROMPT)


def _worker(model, prompts, schema=SCHEMA) -> SchemaWorker:
    proc = json_schema_processor(model.tokenizer, schema, model.eos_token_ids, prompts=prompts)
    assert isinstance(proc, SchemaWorker)
    return proc


def _in_process(model, schema=SCHEMA) -> SchemaProcessor:
    return json_schema_processor(model.tokenizer, schema, model.eos_token_ids, timeout=None)


def _gone(seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while workers() and time.monotonic() < end:
        time.sleep(0.02)
    return not workers()


def test_the_workers_masks_are_the_in_process_parsers_bit_for_bit(default_model, prompt):
    """A random walk through the schema's texts: every position masked alike, -inf for -inf, asked
    ahead (prefetch, a chain's texts) or on the spot; a drafter's q is left as it is until asked."""
    worker, mine = _worker(default_model, [prompt]), _in_process(default_model)
    gen, ids, vocab = torch.Generator().manual_seed(3), list(prompt), default_model.vocab_size
    for step in range(40):
        logits = torch.randn(vocab, generator=gen)
        if step % 3 == 1:
            with drafting():  # not asked yet: q unprocessed, and the text asked for
                assert worker([*ids, 5, 6], logits) is logits
            while not worker.prefetch([ids]):
                worker.conn.poll(0.05)
        want = mine(ids, logits)
        assert torch.equal(worker(ids, logits), want)
        allowed = (want > float("-inf")).nonzero().flatten()
        tok = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        if tok in default_model.eos_token_ids:
            break
        ids.append(tok)
    assert len(ids) > len(prompt) + 5 and not worker.failed
    worker.close()
    assert _gone()


@pytest.mark.parametrize("sampled", [False, True])
def test_generation_through_the_worker_is_the_in_process_parsers(default_model, plain, prompt, sampled):
    """Speculative (ngram) and plain decoding with the worker give the text the in-process parser
    gives, greedy and seeded-sampled."""
    settings = dict(temperature=0.8, seed=11) if sampled else {}
    ref = plain.generate_ids([prompt], max_new_tokens=24, logits_processors=[_in_process(default_model)],
                            **settings)[0]
    for drafter, gamma in [(NoDrafter(), None), (NgramDrafter(), 4)]:
        gen = speculant.Generator(default_model, drafter, gamma=gamma)
        worker = _worker(default_model, [prompt])
        out = gen.generate_ids([prompt], max_new_tokens=24, logits_processors=[worker], **settings)[0]
        assert out.token_ids == ref.token_ids and not worker.failed
        worker.close()
    assert _gone()


def _slow_parser(monkeypatch, seconds: float, after: int, busy: bool = False):
    """The parser's states past ``after`` tokens take ``seconds`` each, ``busy`` in Python or in C
    (a loop that no exception stops); in the parsers' processes too (forked by a new host, forked from this process now: it
    has the patches, and the limits patched before)."""
    compute = SchemaProcessor._compute

    def slow(self, ids):
        if len(ids) > after:
            end = time.monotonic() + seconds
            while busy and time.monotonic() < end:
                pass
            if not busy:
                sum(range(int(seconds * 2e7)))
        return compute(self, ids)

    monkeypatch.setattr(SchemaProcessor, "_compute", slow)
    monkeypatch.setattr(schema_worker, "_HOSTS", {})


def test_a_slow_parser_holds_no_other_batch(default_model, plain, prompt, monkeypatch):
    """While a schema's state takes 3 s in its child, another batch runs to its end: the schema's
    step waits (WAITING) instead of working on the engine thread; then it goes on, exactly."""
    ref = plain.generate_ids([prompt], max_new_tokens=4, logits_processors=[_in_process(default_model)])[0]
    monkeypatch.setattr(constrain, "SCHEMA_STATE_SECONDS", 10.0)
    monkeypatch.setattr(constrain, "SCHEMA_REQUEST_SECONDS", 20.0)
    _slow_parser(monkeypatch, 3.0, len(prompt) + 2)
    worker = _worker(default_model, [prompt])
    engine = plain.engine
    schema = plain.start_batch([prompt], [4], [[]], logits_processors=[worker])
    other = plain.start_batch([plain.encode("Count to five.")], [8], [[]])
    tokens, waited, passes = [], 0, 0
    steps = engine.step(schema)
    while not schema.done:
        item = next(steps, None)
        if item is None:
            steps = engine.step(schema)
        elif item is WAITING:
            waited += 1
            if not other.done:
                for _ in engine.step(other):
                    pass
                passes += 1
            else:
                engine.wait([schema], 0.05)
        else:
            tokens += item[1]
    assert other.done and passes >= 8 and waited > passes  # the other batch ended while the schema waited
    assert tokens == ref.token_ids
    for b in (schema, other):
        engine.finish(b)
    worker.close()
    assert _gone()


@pytest.mark.parametrize("busy", [True, False])
def test_a_parser_past_its_budget_ends_the_request_and_says_why(default_model, plain, prompt, monkeypatch, busy):
    """Python work past a state's bound is stopped in the child, which says so; work the child
    cannot stop (in C) is given up by the engine's side a second later, and the child ends at its
    alarm."""
    monkeypatch.setattr(constrain, "SCHEMA_STATE_SECONDS", 0.2)
    _slow_parser(monkeypatch, 30.0, len(prompt) + 1, busy)
    worker = _worker(default_model, [prompt])
    t0 = time.monotonic()
    out = plain.generate_ids([prompt], max_new_tokens=8, logits_processors=[worker])[0]
    assert time.monotonic() - t0 < 10
    why = "one token needs more than 0.2 s of parser work" if busy else "its parser did not answer within 1.2 s"
    assert worker.failed and why in worker.failed
    assert out.finish_reason == "eos" and len(out.token_ids) <= 3  # its row ended with EOS
    assert _gone()


def test_a_child_that_ends_fails_its_request(default_model, prompt):
    worker = _worker(default_model, [prompt])
    for pid in workers():
        os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 5
    while not worker.prefetch([[*prompt, 90]]) and time.monotonic() < end:
        time.sleep(0.02)
    assert worker.failed and "parser process has ended" in worker.failed
    logits = torch.zeros(default_model.vocab_size)
    kept = (worker([*prompt, 90], logits) > float("-inf")).nonzero().flatten().tolist()
    assert kept == sorted(t for t in default_model.eos_token_ids if t < default_model.vocab_size)
    assert _gone()

"""Nothing a request sends holds the engine, the GIL or the queue: a JSON schema's parser work is
bounded per token and per request (over it the request ends with an error, its batch goes on), a
job past its deadline leaves its batch and the queue, a job that does not fit the memory lets
smaller ones pass for a while, the kernels run without the GIL, ``/health`` says when the engine
stalls."""
from __future__ import annotations

import threading
import time
import types

import httpx
import pytest
import torch

from speculant import constrain
from speculant.constrain import SchemaProcessor, _Late, _WATCHDOG
from speculant.errors import SpeculantError
from speculant.models import quantized
from speculant.models.quantized import QuantLinear, QuantWeight
from speculant.server import scheduler as scheduler_module
from speculant.server.scheduler import Job, Refused, Scheduler
from helpers import Served, save_tiny_folder
from test_quantized import ISA


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_watchdog_stops_a_busy_thread_and_nothing_lands_after_its_limit():
    t0 = time.monotonic()
    with pytest.raises(_Late):
        with _WATCHDOG.limit(0.05):
            _busy(30)
    assert time.monotonic() - t0 < 5
    for _ in range(300):  # limits that end about when the work does: a raise never lands outside them
        try:
            with _WATCHDOG.limit(0.0003):
                _busy(0.0003)
        except _Late:
            pass
        _busy(0.0005)  # a stray raise would land here and fail the test


def _processor(eos=(7, 9), quiet=False) -> SchemaProcessor:
    """A processor whose parser is slow on purpose (its prompt's state given)."""
    proc = SchemaProcessor(types.SimpleNamespace(eos_token_id=list(eos)), end_quietly=quiet)
    proc.states[proc._key([1, 2])] = types.SimpleNamespace(allowed_tokens=types.SimpleNamespace(allowed_tokens=[3]))
    return proc


def test_one_tokens_parser_work_is_bounded(monkeypatch):
    monkeypatch.setattr(constrain, "SCHEMA_STATE_SECONDS", 0.05)
    proc = _processor()
    proc._compute = lambda ids: _busy(30)
    t0 = time.monotonic()
    with pytest.raises(SpeculantError, match="one token needs more than 0.05 s of parser work"):
        proc.allowed([1, 2, 3])
    assert time.monotonic() - t0 < 5
    with pytest.raises(SpeculantError, match="too costly"):  # and it stays failed, without more work
        proc.allowed([1, 2, 4])


def test_a_requests_parser_work_is_bounded_and_the_server_ends_its_rows_quietly(monkeypatch):
    monkeypatch.setattr(constrain, "SCHEMA_STATE_SECONDS", 10.0)
    monkeypatch.setattr(constrain, "SCHEMA_REQUEST_SECONDS", 0.2)
    monkeypatch.setattr(constrain, "SCHEMA_STATE_SHARE", 0.0)
    proc = _processor(quiet=True)

    def compute(ids):
        _busy(0.03)
        proc.states[proc._key(ids)] = proc.states[proc._key([1, 2])]
        return [5]

    proc._compute = compute
    got, ids = [], [1, 2]
    for t in range(100):
        ids = ids + [t + 10]
        got.append(proc.allowed(ids))
        if proc.failed:
            break
    assert proc.failed and "more parser work than a request may take" in proc.failed
    assert got[0] == [5] and got[-1] == [7, 9]  # its rows end with EOS: the scheduler says why
    assert 0.15 < proc.spent < 1.0
    assert proc.allowed(ids + [1]) == [7, 9]


class _Passes:
    """Stands in for a Generator and its engine: every batch runs until its rows are cancelled or
    ``passes`` passes have run (None: its longest max_tokens); what each pass does is ``on_pass``'s."""

    def __init__(self, passes=5, on_pass=None):
        self.engine, self.passes, self.on_pass, self.gamma = self, passes, on_pass, 0
        self.ended = threading.Event()

    def start_batch(self, prompts, max_tokens, stops, seed=None, cancelled=None, **sampling):
        rows = [types.SimpleNamespace(finished=False, tokens=[], limit=m) for m in max_tokens]
        return types.SimpleNamespace(done=False, rows=rows, active=list(range(len(rows))), left=self.passes or max(max_tokens),
                                     accepts_rows=False, cancelled=cancelled)

    def step(self, batch):
        if self.on_pass:
            self.on_pass()
        batch.left -= 1
        for r in list(batch.active):
            if batch.cancelled(r) or batch.left <= 0:
                batch.rows[r].finished = True
                batch.active.remove(r)
        batch.done = not batch.active
        return iter(())

    def finish(self, batch):
        self.ended.set()
        return []

    def outputs(self, rows, stop):
        return ["out"] * len(rows)

    def memory_needed(self, rows, prompt_tokens, max_tokens, gamma, extra=0):
        return rows * max_tokens


def test_a_job_whose_schema_gave_up_ends_with_its_error_and_its_batch_goes_on():
    broken = types.SimpleNamespace(failed=None)
    passes = [0]

    def on_pass():
        passes[0] += 1
        if passes[0] == 2:
            broken.failed = "the JSON schema is too costly to follow"

    gen, got = _Passes(passes=5, on_pass=on_pass), {}
    sched = Scheduler(gen, max_batch_size=4)
    sink = lambda name: (lambda ev: got.setdefault(name, ev))  # noqa: E731
    try:
        sched.submit([Job([0], 8, sink("schema"), sampling={"logits_processors": [broken]}, group="a"),
                      Job([1], 8, sink("plain"), group="a")])
        assert gen.ended.wait(10)
    finally:
        sched.close()
    kind, message = got["schema"]
    assert kind == "error" and isinstance(message, Refused) and message.status == 422 and "too costly" in message
    assert got["plain"] == ("done", "out") and passes[0] == 5  # the other row ran to its end


def test_a_job_past_its_deadline_leaves_its_batch_and_a_waiting_one_the_queue():
    gen, got = _Passes(passes=10 ** 6, on_pass=lambda: time.sleep(0.01)), {}
    sched = Scheduler(gen, max_batch_size=1, request_timeout=0.3)
    sink = lambda name: (lambda ev: got.setdefault(name, ev))  # noqa: E731
    try:
        t0 = time.monotonic()
        sched.submit([Job([0], 8, sink("running"), group="a")])
        sched.submit([Job([1], 8, sink("waiting"), group="b")])
        assert gen.ended.wait(10)
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sched.close()
    assert time.monotonic() - t0 < 5
    for name in ("running", "waiting"):
        kind, message = got[name]
        assert kind == "error" and message.status == 408, got


def test_a_job_that_does_not_fit_lets_smaller_ones_pass_for_a_while_then_they_wait(monkeypatch):
    sched = Scheduler(_Passes(), max_batch_size=8, memory_budget=1000)
    try:
        big, small = Job([0], 5000, lambda ev: None, group="a"), Job([1], 10, lambda ev: None, group="a")
        with sched.lock:
            sched.waiting.extend([big, small])
            assert sched._take("a", 8, []) == [small]  # the big one has just come: the small one passes
            small2 = Job([2], 10, lambda ev: None, group="a")
            sched.waiting.append(small2)
            big.queued_at -= scheduler_module.HOLD_AFTER + 1
            assert sched._take("a", 8, []) == []  # it has waited long: the others wait behind it
            got = []
            big.sink = got.append
            big.queued_at -= scheduler_module.MEMORY_WAIT
            sched._expire()
        assert got and got[0][1].status == 429 and "waited" in got[0][1]
        assert big not in sched.waiting and small2 in sched.waiting
    finally:
        with sched.lock:
            sched.waiting.clear()
        sched.close()


def test_the_kernels_run_without_the_gil():
    if quantized.kernels() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    g = torch.Generator().manual_seed(0)
    lin = QuantLinear(QuantWeight.quantize(torch.randn(4096, 4096, generator=g) * 0.05, 8), int8=True)
    x = torch.randn(512, 4096, generator=g)
    inside, took = threading.Event(), []

    def work():
        inside.set()
        t = time.perf_counter()
        for _ in range(3):
            lin(x)
        took.append(time.perf_counter() - t)

    worker = threading.Thread(target=work)
    worker.start()
    assert inside.wait(10)
    gaps, last = [], time.perf_counter()
    while worker.is_alive():  # this thread's Python steps while the kernels run
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        time.sleep(0.001)
    worker.join()
    assert took[0] > 0.05, "the work is too short to tell"
    assert max(gaps) < took[0] / 2, f"this thread waited {max(gaps):.3f} s of {took[0]:.3f} s"


def test_the_recursive_schema_ends_with_an_error_and_the_server_goes_on(tmp_path):
    pytest.importorskip("lmformatenforcer")
    import speculant

    from test_hardening import save_char_folder

    gen = speculant.load(str(save_char_folder(tmp_path / "chars")), drafter="ngram", device="cpu", dtype="float32")
    branches = [{"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
                 "description": f"v{i}"} for i in range(16)]
    schema = {"$defs": {"n": {"anyOf": branches}}, "$ref": "#/$defs/n"}
    s = Served(gen)
    try:
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Answer in JSON:", "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        took = time.monotonic() - t0
        assert r.status_code in (200, 400, 422), r.text  # an answer, or its error
        if r.status_code != 200:
            assert "JSON schema" in r.json()["error"]["message"], r.text
        assert took < 20
        ok = httpx.post(s.url + "/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200
        assert httpx.get(s.url + "/health", timeout=5).json()["status"] == "ok"
    finally:
        s.close()


def test_health_says_when_no_pass_has_ended_for_long():
    gen = _Passes(passes=3, on_pass=lambda: time.sleep(0.3))
    sched = Scheduler(gen, max_batch_size=1)
    try:
        assert not sched.stalled(0.1)
        sched.submit([Job([0], 8, lambda ev: None, group="a")])
        time.sleep(0.2)
        assert sched.stalled(0.1) and not sched.stalled(5)
        assert gen.ended.wait(10)
        deadline = time.monotonic() + 10
        while sched.stepping and time.monotonic() < deadline:  # the batch's memory going back
            time.sleep(0.01)
        assert not sched.stalled(0.1)
    finally:
        sched.close()


def test_another_groups_request_runs_beside_a_long_batch_not_after_it():
    """A long request of one group (a JSON schema's) and a short one of another: the short one's
    batch starts beside the long one's and ends first (with one batch at a time it waited for the
    long one's end)."""
    for max_batches, short_first in ((4, True), (1, False)):
        gen, ended = _Passes(passes=None, on_pass=lambda: time.sleep(0.002)), {}
        sched = Scheduler(gen, max_batch_size=4, max_batches=max_batches)

        def sink(name):
            return lambda ev: ev[0] == "done" and ended.setdefault(name, time.monotonic())

        try:
            sched.submit([Job([0], 300, sink("long"), group="schema")])
            time.sleep(0.05)
            sched.submit([Job([1], 5, sink("short"), group="plain")])
            deadline = time.monotonic() + 20
            while len(ended) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            sched.close()
        assert len(ended) == 2 and (ended["short"] < ended["long"]) == short_first, (max_batches, ended)


@pytest.mark.parametrize("isa", sorted(ISA))
def test_a_long_prompt_prefilled_in_chunks_gives_the_very_text_of_one_prefill(tmp_path, monkeypatch, isa):
    """q8 (each row the same bits at any width, keys read back from the cache as written): a prompt
    prefilled 64 tokens a step, or steps of other sizes each (as the scheduler's time slices give),
    with another batch started and stepped between its chunks, gives the very tokens of one
    prefill, greedy and seeded-sampled, and it did yield between chunks; on every x86 branch
    (AVX-512, AVX2, plain vectors) built on this CPU."""
    import platform

    import speculant
    from helpers import write_tiny_gguf

    if isa != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ISA flags for x86 only")
    module = quantized.build(ISA[isa])
    if module is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    monkeypatch.setattr(quantized, "kernels", lambda: module)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_K", arch="qwen2", bias=True)
    gen = speculant.load(str(path), drafter="ngram", dtype="q8", device="cpu")
    assert module.isa() in gen.engine.backend.info()["cpu_kernels"]  # this build's branch runs the passes
    g = torch.Generator().manual_seed(5)
    long = torch.randint(0, 256, (300,), generator=g).tolist()
    long = long[:150] + long[:150]  # a repeat, so prompt lookup drafts
    short = [7, 8, 9, 10]
    sizes = iter([7, 64, 1, 33, 100, 16] * 10)
    for sampling, chunk, expected in [({"temperature": 0.0}, 64, 4), ({"temperature": 0.8, "seed": 11}, 64, 4),
                                      ({"temperature": 0.0}, lambda: next(sizes), 9)]:
        seed = sampling.get("seed")
        settings = {k: v for k, v in sampling.items() if k != "seed"}
        want = gen.generate_ids([long], max_new_tokens=24, seed=seed, **settings)[0].token_ids
        steps = gen.start_batch([long], [24], [[]], seed=seed, chunk=chunk, **settings)
        chunks, other, batch = 0, None, None
        while batch is None:
            try:
                next(steps)
                chunks += 1
                if other is None:  # another batch starts and runs between this one's chunks
                    other = gen.start_batch([short], [8], [[]])
                else:
                    list(gen.engine.step(other))
            except StopIteration as done:
                batch = done.value
        while not batch.done:
            list(gen.engine.step(batch))
        got = gen.engine.finish(batch)[0].tokens
        gen.engine.finish(other)
        assert chunks == expected and got == want, (sampling, chunks)
        assert gen.generate_ids([short], 8)[0].token_ids  # the engine is whole after


class _Chunked(_Passes):
    """_Passes whose batches prefill in steps: ``steps`` yields of ``seconds`` each for a long prompt."""

    def __init__(self, steps=20, seconds=0.02, **kw):
        super().__init__(**kw)
        self.steps_, self.seconds = steps, seconds
        self.start_steps = True  # what the scheduler looks for on the engine

    def start_batch(self, prompts, max_tokens, stops, seed=None, cancelled=None, chunk=0, **sampling):
        batch = super().start_batch(prompts, max_tokens, stops, seed, cancelled, **sampling)
        if not chunk:
            return batch

        def steps():
            for _ in range(self.steps_):
                time.sleep(self.seconds)
                yield
            return batch

        return steps()


def test_a_short_request_runs_while_a_long_prompt_is_prefilled():
    gen, ended = _Chunked(steps=30, seconds=0.02, passes=None, on_pass=lambda: time.sleep(0.002)), {}
    sched = Scheduler(gen, max_batch_size=4)

    def sink(name):
        return lambda ev: ev[0] == "done" and ended.setdefault(name, time.monotonic())

    try:
        t0 = time.monotonic()
        sched.submit([Job(list(range(1000)), 4, sink("long"), group="a")])
        time.sleep(0.05)  # its prefill has begun
        sched.submit([Job([1, 2, 3], 8, sink("short"), group="a")])
        deadline = time.monotonic() + 20
        while len(ended) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sched.close()
    assert len(ended) == 2 and ended["short"] < ended["long"], ended
    assert ended["long"] - t0 > 30 * 0.02  # every chunk ran


def test_batches_share_the_engines_time_not_its_turns(monkeypatch):
    """Beside a batch whose passes cost 20 ms, one of 2 ms passes gets about as much of the engine's
    time, not a pass each in turn (ten passes to its one); a long prompt's batch (its prefill steps
    and its passes alike) gets a third of what the other gets. A clock that only the passes move:
    no timing in the test."""
    now = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter, sleep=time.sleep)
    monkeypatch.setattr(scheduler_module, "time", clock)  # the scheduler's clock alone
    cost = {0: 0.020, 1: 0.002}  # by the prompt's first token
    counts = {0: 0, 1: 0}  # passes (and prefill steps) while the fast batch runs
    fast = [False]

    class Costed(_Chunked):
        def start_batch(self, prompts, max_tokens, stops, seed=None, cancelled=None, chunk=0, **sampling):
            made = super().start_batch(prompts, max_tokens, stops, seed, cancelled, chunk, **sampling)
            fast[0] |= prompts[0][0] == 1
            batch = made if not chunk else None
            if batch is not None:
                batch.kind = prompts[0][0]
                return batch

            def steps():  # a long prompt: its prefill's steps cost what its passes do
                batch = yield from made
                batch.kind = prompts[0][0]
                return batch

            return steps()

        def step(self, batch):
            now[0] += cost[batch.kind]
            counts[batch.kind] += fast[0]
            out = super().step(batch)
            fast[0] &= not (batch.kind == 1 and batch.done)
            return out

    for long_prompt, share in ((False, 1.0), (True, 1 / scheduler_module.LONG_WEIGHT)):
        counts.update({0: 0, 1: 0})
        gen = Costed(steps=0, seconds=0.0, passes=None)
        sched = Scheduler(gen, max_batch_size=4)
        slow = [0] * (scheduler_module.LONG_PROMPT + 1) if long_prompt else [0]
        try:
            done = threading.Event()
            sched.submit([Job(slow, 10**9, lambda ev: None, group="slow")])
            deadline = time.monotonic() + 20
            while not sched.batches and time.monotonic() < deadline:
                time.sleep(0.001)
            sched.submit([Job([1], 400, lambda ev: ev[0] == "done" and done.set(), group="fast")])
            assert done.wait(20)
            fast_time, slow_time = counts[1] * cost[1], counts[0] * cost[0]
        finally:
            for j in list(sched.running):
                j.cancelled = True
            sched.close()
        # while the fast batch ran (its 400 passes), the slow one had about its share of the time
        assert 0.5 * share < slow_time / fast_time < 2.0 * share, (long_prompt, counts)


def test_the_hostile_load_scripts_cases_are_answered_beside_ordinary_requests(tmp_path, monkeypatch):
    """speculant.bench.hostile_load's machinery on a tiny server: a case's status and message, the
    ordinary requests beside it and /health probes recorded."""
    import speculant
    from speculant.bench import hostile_load

    gen = speculant.load(str(save_tiny_folder(tmp_path / "tiny", vocab=96)), drafter="ngram", device="cpu",
                         dtype="float32")
    monkeypatch.setattr(hostile_load, "ORDINARY", {"prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0})
    s = Served(gen, api_key=hostile_load.KEY)
    try:
        s.app.state.server.model_name = "bench"
        row = hostile_load.run_case(s.url, hostile_load.cases("w1 " * 50)["lone surrogate model"])
    finally:
        s.close()
    assert row["statuses"] == [404] and "\\ud800" in row["message"]
    assert row["ordinary_requests"] >= 3 and row["health_probes"] >= 1

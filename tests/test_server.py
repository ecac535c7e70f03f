"""``speculant serve``: the OpenAI client against a server started here on a loopback port.

Answers equal Hugging Face greedy decoding; streaming equals non-streaming; every error case gets
OpenAI's error body; a load test (1,000 requests, 64 at once) has no failures; memory does not
grow over a soak; a client that goes away frees its row.
"""
from __future__ import annotations

import asyncio
import gc
import statistics
import threading
import time
import types

import httpx
import openai
import psutil
import pytest
import torch

import speculant
from speculant.errors import SpeculantError
from speculant.server.scheduler import Job, QueueFull, Scheduler
from helpers import Served, hf_greedy, save_tiny_folder

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}w3"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_folder(tmp_path_factory.mktemp("serve") / "tiny", vocab=96)


def _gen(folder, drafter="ngram"):
    gen = speculant.load(str(folder), drafter=drafter, device="cpu", dtype="float32")
    gen.tokenizer.chat_template = CHAT_TEMPLATE
    return gen


@pytest.fixture(scope="module")
def served(folder):
    s = Served(_gen(folder))
    yield s
    s.close()


PROMPTS = ["w5 w6 w7 w5 w6", "w10 w11 w12 w13 w10 w11 w12", "w40 w41 w42"]


def test_completions_equal_hf_greedy_streaming_and_not(served, folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    client = served.client()
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ref = hf_greedy(model, ids, 24)
        ref = ref[: ref.index(1) + 1] if 1 in ref else ref  # </s> ends the answer
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == tok.decode(ref, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ref)
        other = client.completions.create(model="tiny", prompt=prompt + " w3", max_tokens=24, temperature=0)
        two = client.completions.create(model="tiny", prompt=[prompt, prompt + " w3"], max_tokens=24, temperature=0,
                                        n=2)  # each prompt counted once, not once per choice (OpenAI's usage)
        assert two.usage.prompt_tokens == out.usage.prompt_tokens + other.usage.prompt_tokens
        assert two.usage.completion_tokens == 2 * (out.usage.completion_tokens + other.usage.completion_tokens)
        assert out.choices[0].finish_reason == ("stop" if 1 in ref else "length")
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
        assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
        origins = [t for c in chunks for t in c.choices[0].model_extra["speculant"]["tokens"]]
        assert len(origins) == len(ref) and not origins[0]["draft"]  # the prefill's token is the target's own


def test_chat_streaming_equals_non_streaming_and_speculates(served):
    client = served.client()
    messages = [{"role": "user", "content": "w20 w21 w22 w20 w21 w22 w20 w21"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0)
    text = out.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                           extra_body={"speculate": False})
    assert plain.choices[0].message.content == text
    assert plain.model_extra["speculant"]["acceptance_rate"] == 0.0


def test_seeded_choices_share_batches_and_keep_their_text(folder):
    """Seeded choices run in one batch with other sampled requests (seeded and not) and still give
    the text they give alone, which is the Python API's text for that seed."""
    gen = _gen(folder)
    sizes = []
    s = Served(gen)
    record = s.scheduler.on_pass
    s.scheduler.on_pass = lambda rows: (sizes.append(rows), record(rows))
    try:
        client = s.client()
        ask = dict(model="tiny", prompt="w7 w8 w9", max_tokens=16, temperature=1.0, seed=123, n=2)
        alone = [c.text for c in client.completions.create(**ask).choices]
        sizes.clear()
        with httpx.Client(timeout=60) as http:
            others = [{"model": "tiny", "prompt": "w1 w2", "max_tokens": 24, "temperature": 1.0, "seed": k}
                      for k in (None, 5, None, 6)]
            pool = [threading.Thread(target=http.post, args=(s.url + "/v1/completions",), kwargs={"json": o})
                    for o in others]
            for t in pool:
                t.start()
            busy = [c.text for c in client.completions.create(**ask).choices]
            for t in pool:
                t.join()
    finally:
        s.close()
    assert busy == alone and len(set(alone)) == 2
    assert max(sizes) > 2, sizes  # the seeded choices shared a batch
    api = gen.generate("w7 w8 w9", max_new_tokens=16, temperature=1.0, seed=123, chat_template=False)
    assert api.text == alone[0]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "tiny", "prompt": "w1 " * 500, "max_tokens": 100}, 400, "max_tokens"),  # beyond the context
    ({"model": "tiny", "prompt": "w1", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "w1", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "w1", "gamma": 0}, 400, None),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": [5, 100000]}, 400, "prompt"),
    ({"model": "tiny", "prompt": "w1", "logit_bias": {"1000000": 5}}, 400, None),  # refused before it shares a batch
    ({"model": "other", "prompt": "w1"}, 404, "model"),
    ({"model": "tiny", "prompt": "w1", "logit_bias": {"5": 500}}, 400, "logit_bias"),  # OpenAI's -100..100
    ({"model": "tiny", "prompt": "w1", "max_tokens": True}, 400, "max_tokens"),  # not 1 token (lax ints took it)
    ({"model": "tiny", "prompt": "w1", "n": "2"}, 400, "n"),
    ({"model": "tiny", "prompt": "w1", "max_tokens": 4.5}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "w1", "stream": "yes"}, 400, "stream"),
])
def test_bad_requests_get_openai_error_bodies(served, body, status, param):
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "\n" not in err["message"] and err["type"]
    if param:
        assert param in (err["param"] or "") or param in err["message"]


def test_a_schema_the_enforcer_cannot_follow_is_a_400(served):
    pytest.importorskip("lmformatenforcer")
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "w1"}],
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format" and "unusable JSON schema" in err["message"]


def test_malformed_json_and_unsupported_content(served):
    r = httpx.post(served.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for content, kind in ((b"a=b", "application/x-www-form-urlencoded"), (b"", "application/json")):
        r = httpx.post(served.url + "/v1/chat/completions", content=content, headers={"content-type": kind})
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"], r.text
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400 and "text" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "wizard", "content": "w1"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["param"], r.text
    with pytest.raises(openai.BadRequestError):
        served.client().completions.create(model="tiny", prompt="w1 " * 600, max_tokens=10)


def test_models_health_metrics(served):
    assert [m.id for m in served.client().models.list()] == ["tiny"]
    assert httpx.get(served.url + "/health").json()["status"] == "ok"
    served.client().completions.create(model="tiny", prompt="w9 w9 w9 w9", max_tokens=8, temperature=0)
    text = httpx.get(served.url + "/metrics").text
    for name in ("speculant_requests_total", "speculant_generated_tokens_total", "speculant_acceptance_rate",
                 "speculant_tokens_per_pass", "speculant_mean_gamma", "speculant_speculation_on_share",
                 "speculant_queue_depth", "speculant_request_latency_seconds_bucket",
                 "speculant_time_to_first_token_seconds_bucket"):
        assert name in text, name
    generated = [line for line in text.splitlines() if line.startswith("speculant_generated_tokens_total")]
    assert float(generated[0].split()[-1]) > 0


def test_api_key(folder):
    s = Served(_gen(folder), api_key="sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(key="wrong").completions.create(model="tiny", prompt="w1", max_tokens=2)
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "w1"})
        assert r.status_code == 401 and "missing" in r.json()["error"]["message"]
        assert s.client(key="sesame").completions.create(model="tiny", prompt="w1", max_tokens=2).choices
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.close()


class HeldPasses:
    """A served engine whose passes wait until ``release()`` (after ``free`` passes that run at
    once): what a request meets while it runs is the test's to arrange, not the clock's. Events:
    ``holding`` (a pass waits), ``cancelled`` (the server cancelled a request's jobs), ``finished``
    (a batch ended: its rows left the engine)."""

    def __init__(self, served: Served, free: int = 0):
        sched = served.scheduler
        engine, step, finish, cancel = sched.gen.engine, sched.gen.engine.step, sched.gen.engine.finish, sched.cancel
        self.holding, self.released = threading.Event(), threading.Event()
        self.cancelled, self.finished = threading.Event(), threading.Event()
        passes = [0]

        def held_step(batch):
            passes[0] += 1
            if passes[0] > free:
                self.holding.set()
                assert self.released.wait(30), "the test never released the passes"
            yield from step(batch)

        def finish_and_tell(batch):
            try:
                return finish(batch)
            finally:
                self.finished.set()

        def cancel_and_tell(jobs):
            cancel(jobs)
            self.cancelled.set()

        engine.step, engine.finish, sched.cancel = held_step, finish_and_tell, cancel_and_tell

    def release(self):
        self.released.set()


def test_queue_full_is_429_and_timeout_is_408(folder):
    from concurrent.futures import ThreadPoolExecutor

    s = Served(_gen(folder, "none"), max_batch_size=1, max_queue=1, request_timeout=30)
    held = HeldPasses(s)
    queued, submit = threading.Semaphore(0), s.scheduler.submit
    s.scheduler.submit = lambda *a, **kw: (submit(*a, **kw), queued.release())  # a request's jobs are in
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 8, "temperature": 0}
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=60)
            assert queued.acquire(timeout=30) and held.holding.wait(30)  # the one row runs
            second = pool.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=60)
            assert queued.acquire(timeout=30)  # the queue's one place is taken
            refused = [httpx.post(s.url + "/v1/completions", json=body, timeout=60) for _ in range(4)]
            held.release()
            codes = [first.result().status_code, second.result().status_code] + [r.status_code for r in refused]
        assert codes == [200, 200, 429, 429, 429, 429], codes
        # more completions than the queue ever holds: a 400 (a 429 would have the client retry forever)
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-queue 1" in r.text, r.text
    finally:
        s.close()
    s = Served(_gen(folder, "none"), request_timeout=0.3)
    held = HeldPasses(s)  # the request cannot end before its time runs out
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 400,
                                                        "temperature": 0}, timeout=30)
        assert r.status_code == 408 and "longer than" in r.json()["error"]["message"]
        assert held.cancelled.wait(10)
        held.release()
        assert held.finished.wait(10)  # the timed-out row left the engine
        assert s.scheduler.batch_size() == 0
        assert s.app.state.speculant["metrics"].totals["generated"] < 400
    finally:
        s.close()


def test_a_client_that_disconnects_frees_its_row(folder):
    s = Served(_gen(folder, "none"))
    held = HeldPasses(s, free=4)  # a few tokens reach the client, then the passes wait
    try:
        with httpx.Client(timeout=30) as http:
            body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 450, "temperature": 0, "stream": True}
            with http.stream("POST", s.url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]
                assert got[0].startswith("data: ")
        held.release()  # the next tokens find the client gone
        assert held.cancelled.wait(10) and held.finished.wait(10)
        assert s.scheduler.batch_size() == 0
        metrics = s.app.state.speculant["metrics"]
        assert metrics.totals["generated"] < 450  # it stopped early, not at max_tokens
    finally:
        s.close()


def test_a_client_that_gives_up_on_a_plain_request_frees_its_row(folder):
    s = Served(_gen(folder, "none"))
    held = HeldPasses(s)  # the request cannot end before the client gives up
    try:
        body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 500, "temperature": 0}
        with pytest.raises(httpx.TimeoutException):  # the client gives up and closes the connection
            httpx.post(s.url + "/v1/completions", json=body, timeout=0.3)
        assert held.cancelled.wait(10)  # the server saw it leave
        held.release()
        assert held.finished.wait(10)
        assert s.scheduler.batch_size() == 0
        metrics = s.app.state.speculant["metrics"]
        assert metrics.totals["generated"] < 500 and 'status="499"' in metrics.text().decode()
    finally:
        s.close()


def test_scheduler_groups_compatible_jobs_and_refuses_past_its_queue():
    seen = []

    class Recorder:
        """Stands in for a Generator (and its engine): records each batch's prompts, blocks until
        released; its batches end at once (so none takes joiners)."""

        def __init__(self):
            self.started, self.release, self.all_seen = threading.Event(), threading.Event(), threading.Event()
            self.engine = self

        def start_batch(self, prompts, max_tokens, stops, seed=None, cancelled=None, **sampling):
            self.started.set()
            self.release.wait(10)
            seen.append([p[0] for p in prompts])
            if sum(map(len, seen)) == 5:
                self.all_seen.set()
            return types.SimpleNamespace(done=True, rows=[], active=[])

        def finish(self, batch):
            return []

        def outputs(self, rows, stop):
            return []

    gen = Recorder()
    sched = Scheduler(gen, max_batch_size=2, max_queue=4, max_batches=1)
    sink = lambda ev: None  # noqa: E731
    try:
        sched.submit([Job([0], 1, sink, group="a")])
        assert gen.started.wait(10)  # job 0 is running (held in its prefill)
        sched.submit([Job([1], 1, sink, group="a"), Job([2], 1, sink, group="b"), Job([3], 1, sink, group="a"),
                      Job([4], 1, sink, group="a")])
        with pytest.raises(QueueFull):
            sched.submit([Job([5], 1, sink, group="a")])
        gen.release.set()
        assert gen.all_seen.wait(10)
    finally:
        sched.close()
    assert seen == [[0], [1, 3], [2], [4]]


def test_scheduler_joins_only_while_no_other_group_waits_ahead_and_a_failed_joiner_fails_alone():
    """With one batch at a time (``max_batches=1``), a running batch takes waiting jobs of its group
    between passes, but not past a job of another group that waits ahead of them (first come, first
    served: that job's batch starts when this one drains); a joiner whose prefill fails gets the
    error, the running rows go on."""
    events = []

    class Passes:
        """Stands in for a Generator and its engine: a batch runs 3 passes per row it holds, each
        pass held until the test lets it end (``during_a_pass``), so what arrives during which pass
        is the test's to say."""

        def __init__(self):
            self.engine = self
            self.in_pass, self.let_pass_end = threading.Semaphore(0), threading.Semaphore(0)
            self.three_ended = threading.Event()

        def start_batch(self, prompts, max_tokens, stops, seed=None, cancelled=None, **sampling):
            ids = [p[0] for p in prompts]
            if 99 in ids:
                raise SpeculantError("prompt 99 fails")
            events.append(("start", ids))
            return types.SimpleNamespace(done=False, rows=[], active=list(ids), passes=3, accepts_rows=True)

        def join(self, batch, other):
            events.append(("join", other.active))
            batch.active += other.active
            batch.passes += 3

        def step(self, batch):
            self.in_pass.release()
            assert self.let_pass_end.acquire(timeout=10)
            batch.passes -= 1
            batch.done = batch.passes <= 0
            return iter(())

        def finish(self, batch):
            events.append(("end", batch.active))
            if sum(e[0] == "end" for e in events) == 3:
                self.three_ended.set()
            return []

        def outputs(self, rows, stop):
            return []

        def during_a_pass(self, submit):
            """Submit while a pass runs: the scheduler sees the jobs between this pass and the next."""
            assert self.in_pass.acquire(timeout=10)
            submit()
            self.let_pass_end.release()

    got = {}
    gen = Passes()
    sched = Scheduler(gen, max_batch_size=8, max_queue=8, max_batches=1)
    sink = lambda name: (lambda ev: got.setdefault(name, ev))  # noqa: E731
    try:
        sched.submit([Job([0], 1, sink(0), group="a")])
        gen.during_a_pass(lambda: sched.submit([Job([1], 1, sink(1), group="a")]))  # [1] joins after it
        gen.during_a_pass(lambda: sched.submit([Job([99], 1, sink(99), group="a")]))  # [99] fails alone
        gen.during_a_pass(lambda: sched.submit([Job([2], 1, sink(2), group="b"), Job([3], 1, sink(3), group="a")]))
        gen.let_pass_end.release(100)  # the rest runs on its own
        assert gen.three_ended.wait(10)
    finally:
        sched.close()
    assert events == [("start", [0]), ("start", [1]), ("join", [1]), ("end", [0, 1]), ("start", [2]), ("end", [2]),
                      ("start", [3]), ("end", [3])], events
    assert got[99] == ("error", "prompt 99 fails")


@pytest.fixture
def served_plain_kernels(folder, monkeypatch):
    """A server whose matmuls run on F.linear: oneDNN's packed kernels keep a compiled primitive per
    new shape in a cache of up to 1,024 (measured: +25 MiB of RSS over 1,800 requests of varied batch
    shapes here, flat with F.linear), which would read as growth in a soak meant to find leaks of ours."""
    monkeypatch.setenv("SPECULANT_CPU_KERNELS", "aten")
    s = Served(_gen(folder))
    yield s
    s.close()


def test_load_1000_requests_64_concurrent_then_memory_stays_flat(served_plain_kernels):
    served = served_plain_kernels
    async def one(client, i, latencies):
        t = time.perf_counter()
        out = await client.completions.create(model="tiny", prompt=PROMPTS[i % 3], max_tokens=8,
                                              temperature=0 if i % 2 else 0.8)
        latencies.append(time.perf_counter() - t)
        return out.choices[0].text

    async def wave(n, concurrent=64):
        gate, latencies = asyncio.Semaphore(concurrent), []
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def run(i):
            async with gate:
                return await one(client, i, latencies)

        t = time.perf_counter()
        texts = await asyncio.gather(*[run(i) for i in range(n)], return_exceptions=True)
        return texts, latencies, time.perf_counter() - t

    texts, lat, secs = asyncio.run(wave(1000))
    failures = [t for t in texts if isinstance(t, Exception)]
    assert not failures, failures[:3]
    q = statistics.quantiles(lat, n=100)
    print(f"\nload: 1000 requests, 64 concurrent: {1000 / secs:.1f} req/s, p50 {q[49] * 1000:.0f} ms, "
          f"p99 {q[98] * 1000:.0f} ms")
    greedy = {t for i, t in enumerate(texts) if i % 2 and i % 3 == 0}
    assert len(greedy) == 1  # the same greedy request gives the same text in any batch
    proc = psutil.Process()
    rss = []
    for _ in range(4):  # soak: after the first round, more rounds must not keep growing memory
        texts, _, _ = asyncio.run(wave(300))
        assert not [t for t in texts if isinstance(t, Exception)]
        gc.collect()
        rss.append(proc.memory_info().rss / 2**20)
    print("soak: RSS after each round of 300 requests (MiB): " + ", ".join(f"{m:.0f}" for m in rss))
    assert rss[-1] - rss[0] < 24, rss


def test_two_streams_of_one_generator_advanced_alternately_give_their_texts_alone(folder):
    """Each stream is a batch of its own (its own cache and drafter state), so streams of one
    Generator may be advanced in any order: greedy, and sampled with a seed and a fixed γ."""
    gen = _gen(folder)
    prompts = ["w5 w6 w7", "w9 w8", "w3 w3 w4 w4"]
    for kw in ({}, {"temperature": 0.9, "seed": 3, "gamma": 3}):
        alone = [gen.generate(p, max_new_tokens=12, chat_template=False, **kw).text for p in prompts]
        streams = [gen.stream(p, max_new_tokens=12, chat_template=False, **kw) for p in prompts]
        texts, live = [""] * 3, [True] * 3
        while any(live):
            for i in (2, 0, 1):
                if live[i]:
                    try:
                        texts[i] += next(streams[i])
                    except StopIteration:
                        live[i] = False
        assert texts == alone, kw
        if not kw:
            greedy = alone
    closed = gen.stream("w1 w2", max_new_tokens=12, chat_template=False)
    next(closed)
    closed.close()  # closing a stream gives its caches and drafter back
    assert not gen.engine.drafter_busy
    assert gen.generate("w9 w8", max_new_tokens=12, chat_template=False).text == greedy[1]


def test_requests_arriving_mid_batch_join_it_and_answer_as_alone(folder):
    """Continuous batching: a request that arrives while a batch runs is prefilled and joins it
    between passes, here a seeded sampled one joining a greedy one (the pass sizes show two rows
    decoded together), and both answers are what each gives alone."""
    gen = _gen(folder)
    sizes = []
    s = Served(gen)
    sched = s.scheduler
    record = sched.on_pass
    sched.on_pass = lambda rows: (sizes.append(rows), record(rows))
    try:
        client = s.client()
        # the long request's 160 tokens: time enough for the short one to arrive while it runs (with 40 a
        # fast 2-core machine finished it first now and then)
        alone = [client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=t, seed=4).choices[0].text
                 for p, n, t in (("w5 w6 w7", 160, 0), ("w9 w8", 12, 0.8))]
        sizes.clear()
        long = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=160, temperature=0, stream=True)
        first = [next(long)]  # the long request is running
        short = client.completions.create(model="tiny", prompt="w9 w8", max_tokens=12, temperature=0.8, seed=4)
        text_long = "".join(c.choices[0].text for c in first + list(long))
    finally:
        s.close()
    assert [text_long, short.choices[0].text] == alone
    assert max(sizes) == 2, sizes


def test_streamed_text_is_incremental_and_never_shows_what_a_stop_string_cuts(folder):
    """TextStream decodes only the new tokens with the piece before them: the pieces add up to the
    whole text however the tokens arrive, and with a stop string every piece shown stays a prefix
    of the final (cut) text: the start of a stop string is held back until it is known."""
    import random

    from speculant.api import TextStream, _cut_at_stop

    gen = _gen(folder)
    rng = random.Random(0)
    for trial in range(20):
        ids = [rng.randrange(2, 96) for _ in range(40)]
        full = gen.decode(ids)
        stop = [gen.decode(ids[25:27])] if trial % 2 else None  # a stop string the text contains
        final = _cut_at_stop(full, stop)
        stream, shown, i = TextStream(gen.decode, stop), "", 0
        while i < len(ids):
            k = rng.randint(1, 4)
            shown += stream.add(ids[i : i + k])
            assert final.startswith(shown), (shown, final)
            i += k
        assert shown + stream.finish(final) == final


def test_sixteen_concurrent_bf16_greedy_requests_answer_as_each_alone(folder):
    """In bfloat16 too: rows verified beside other requests (and padded to the widest of them) get
    their bits alone, so a request's greedy text does not depend on what else the server runs."""
    gen = speculant.load(str(folder), drafter="ngram", device="cpu", dtype="bfloat16")
    gen.tokenizer.chat_template = CHAT_TEMPLATE
    prompts = [" ".join(f"w{(7 * i + j) % 90 + 3}" for j in range(3 + i % 5)) * (1 + i % 3) for i in range(16)]
    s = Served(gen)
    try:
        client = s.client()
        alone = [client.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0).choices[0].text
                 for p in prompts]
        results = [None] * len(prompts)

        def ask(i):
            results[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=20,
                                                   temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        s.close()
    assert results == alone

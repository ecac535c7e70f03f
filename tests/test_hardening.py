"""Hardening, second round (issue 38): what a hostile client tried and the earlier tables lacked.

- Numbers valid by their ranges generate, however extreme (temperature 1e-45 or 5e-324, repetition
  penalty 1e-300, top_p near 0, min_p 1, penalties and biases of 1e308): the sampling math stays
  finite (hypothesis over the extremes), a tiny temperature is greedy in the limit.
- Every 400 in OpenAI's words: strings and booleans in numeric fields, empty messages, unknown
  roles, wrong types of every field, JSON schemas past the bounds; each answered within a second.
- tools / tool_choice: "required" and a named function give ``tool_calls`` (streamed and not);
  "auto" and the deprecated forms get a clear 400, never silence.
- Files that are not regular files, unreadable or truncated GGUFs, names too long: one line in the
  Python API and the CLI, within a second; drafter specs of any shape refused or parsed at once.
- The body guard counts a body of 200,000 chunks in linear time; a JSON schema is prepared off the
  engine, within its time limit, and a request running meanwhile keeps its pace.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import speculant
from speculant.errors import SpeculantError
from speculant.sampling import Context, LogitsProcessing, SamplingParams
from helpers import LEAKS, C, H, Served, assert_openai_error, chat, completion, post_json, save_tiny_folder

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}w3"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_folder(tmp_path_factory.mktemp("hardening") / "tiny", vocab=96)


@pytest.fixture(scope="module")
def gen(folder):
    g = speculant.load(str(folder), drafter="ngram", device="cpu", dtype="float32")
    g.tokenizer.chat_template = CHAT_TEMPLATE
    return g


@pytest.fixture(scope="module")
def served(gen):
    s = Served(gen)
    yield s
    s.close()


# ---- sampling at the extremes ----
EXTREMES = [dict(temperature=1e-45), dict(temperature=5e-324), dict(temperature=1.0, repetition_penalty=1e-300),
            dict(temperature=1e-45, repetition_penalty=1e-300), dict(temperature=1.0, top_p=1e-300),
            dict(temperature=1.0, top_p=5e-324), dict(temperature=1.0, min_p=1.0), dict(temperature=1.0, min_p=0.999999),
            dict(temperature=1.0, presence_penalty=1e308, frequency_penalty=-1e308),
            dict(temperature=0.5, logit_bias={3: 1e308, 4: -1e308}), dict(temperature=1e308),
            dict(temperature=2.0, repetition_penalty=1e308), dict(temperature=1e-300, top_k=1)]

FLOATS = st.one_of(st.floats(min_value=0, max_value=1e-30, allow_subnormal=True),
                   st.floats(min_value=1e30, max_value=1e308), st.floats(min_value=1e-6, max_value=10),
                   st.sampled_from([5e-324, 1e-45, 2.0**-126, 1.0, 1e308]))


@settings(max_examples=150, deadline=None)
@given(temperature=FLOATS, rp=FLOATS.filter(lambda x: x > 0), top_p=FLOATS.filter(lambda x: 0 < x <= 1),
       min_p=st.one_of(st.just(1.0), st.floats(0, 1)), presence=st.floats(-1e308, 1e308),
       frequency=st.floats(-1e308, 1e308), bias=st.floats(-1e308, 1e308), top_k=st.integers(0, 96),
       scale=st.sampled_from([1e-30, 1.0, 30.0, 1e30]))
def test_processing_stays_a_distribution_at_any_valid_setting(temperature, rp, top_p, min_p, presence, frequency,
                                                             bias, top_k, scale):
    params = SamplingParams(temperature=temperature, repetition_penalty=rp, top_p=top_p, min_p=min_p,
                            presence_penalty=presence, frequency_penalty=frequency, logit_bias={5: bias},
                            top_k=top_k)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 96, generator=g) * scale
    seen = torch.rand(2, 3, 96, generator=g) < 0.5
    proc = LogitsProcessing(params, 96)
    ctx = Context(seen, seen.to(torch.int32) * 3, None)
    if params.greedy:
        return
    probs = proc.probs(logits, ctx)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3), atol=1e-4)
    torch.multinomial(probs.reshape(-1, 96), 1)  # what raised on inf/nan before


def test_p_and_q_are_processed_identically_at_the_extremes():
    """Each row's result is its own: a row with an extreme setting does not change how its batch
    neighbours are computed (a tiny temperature's stable form is taken per row)."""
    logits = torch.randn(4, 96) * 5
    ordinary = SamplingParams(temperature=0.7)
    alone = LogitsProcessing(ordinary, 96).probs(logits[:1])
    mixed = LogitsProcessing([ordinary, SamplingParams(temperature=1e-45), ordinary, ordinary], 96).probs(logits)
    assert torch.equal(mixed[:1], alone)
    tiny = LogitsProcessing(SamplingParams(temperature=1e-45), 96).probs(logits)
    assert torch.equal(tiny.argmax(-1), logits.argmax(-1)) and torch.equal(tiny.amax(-1), torch.ones(4))


def test_a_tiny_temperature_generates_the_greedy_text(gen):
    ids = gen.tokenizer("w5 w6 w7 w5 w6")["input_ids"]
    greedy = gen.generate_ids([ids], max_new_tokens=12)[0].token_ids
    for kw in EXTREMES[:2]:
        assert gen.generate_ids([ids], max_new_tokens=12, seed=3, **kw)[0].token_ids == greedy, kw
    for kw in EXTREMES:
        out = gen.generate_ids([ids], max_new_tokens=6, seed=1, **kw)[0]
        assert len(out.token_ids) >= 1, kw


@pytest.mark.parametrize("kw", EXTREMES[:8], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_the_server_generates_at_every_valid_extreme(served, kw):
    for path, body in ((C, completion(**kw)), (H, chat(**kw, stream=True))):
        t0 = time.monotonic()
        r = post_json(served.url + path, body)
        assert r.status_code == 200, (kw, r.text[:300])
        assert time.monotonic() - t0 < 10


# ---- every 400 in OpenAI's words, within a second ----
NUMERIC = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"]
HOSTILE = [
    *[(C, completion(**{f: "0.5"}), f) for f in NUMERIC], *[(C, completion(**{f: True}), f) for f in NUMERIC],
    *[(H, chat(**{f: [1]}), f) for f in NUMERIC], (C, completion(logit_bias={"5": "1"}), "logit_bias"),
    (C, completion(logit_bias={"5": True}), "logit_bias"), (C, completion(temperature=10**400), "temperature"),
    (C, completion(max_tokens=1e9), "max_tokens"), (C, completion(model=1), "model"),
    (C, completion(stream="yes"), "stream"), (C, completion(stream_options=[1]), "stream_options"),
    (C, completion(stream_options={"include_usage": "yes"}), "include_usage"), (H, chat(logprobs=5), "logprobs"),
    (H, chat(messages=[]), "messages"), (H, chat(messages=[{"role": "wizard", "content": "w1"}]), "role"),
    (H, chat(messages=["hi"]), "messages"), (H, chat(messages=[{"role": "user", "content": "w1", "name": 5}]), "name"),
    (C, completion(n="2"), "n"), (C, completion(seed=True), "seed"), (C, completion(top_k=1.0), "top_k"),
    (C, completion(echo="no"), "echo"), (C, completion(user=["x"]), "user"), (C, completion(speculate=1), "speculate"),
    (C, completion(min_p=1.5), "min_p"), (C, completion(top_p=1.5), "top_p"),
    (H, chat(max_completion_tokens="4"), "max_completion_tokens"), (H, chat(top_logprobs=1.0), "top_logprobs"),
    (H, chat(response_format=[]), "response_format"),
    # JSON schemas past the bounds (speculant.limits): deep, wide, large
    (H, chat(response_format={"type": "json_schema", "json_schema": {"schema": json.loads(
        '{"type": "object", "properties": {"a": ' * 70 + '{"type": "string"}' + "}}" * 70)}}), "nested"),
    (H, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(2000)]}}}), "alternatives"),
    (H, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        f"field_{i}_{'x' * 40}": {"type": "string"} for i in range(2000)}}}}), "bytes"),
    # tools: what is not supported is said, never ignored
    (H, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "auto"),
    (H, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto"), "auto"),
    (H, chat(tool_choice="required"), "tools"), (H, chat(functions=[{"name": "f"}]), "functions"),
    (H, chat(function_call="auto"), "function_call"),
    (H, chat(tools=[{"type": "function", "function": {"name": "f"}}],
             tool_choice={"type": "function", "function": {"name": "g"}}), "g"),
    (H, chat(tools=[{"type": "function", "function": {"name": "a b"}}], tool_choice="required"), "name"),
    (H, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2, tool_choice="required"), "second"),
    (H, chat(tools=[{"type": "retrieval"}], tool_choice="required"), "type"), (H, chat(tools="f"), "tools"),
    (H, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
             response_format={"type": "json_object"}), "response_format"),
    (H, chat(tool_choice="sometimes"), "tool_choice"),
]


def test_the_second_table_of_hostile_requests_gets_openai_words_within_a_second(served):
    for path, body, names in HOSTILE:
        t0 = time.monotonic()
        assert_openai_error(post_json(served.url + path, body), 400, names)
        assert time.monotonic() - t0 < 1.0, (body, time.monotonic() - t0)
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200


NUMBERS = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.floats(0, 1e-300),
                    st.floats(1e300, 1e308), st.integers(-10**30, 10**30), st.text(max_size=6), st.booleans(),
                    st.none(), st.lists(st.integers(), max_size=2))
SCHEMAS = st.recursive(st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean"])}),
                       lambda inner: st.one_of(
                           st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
                               st.text("abc", min_size=1, max_size=3), inner, max_size=5)}),
                           st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
                           st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=6)})),
                       max_leaves=40)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(NUMERIC + ["max_tokens", "n", "top_k", "seed", "gamma"]), NUMBERS,
                               max_size=3), schema=st.none() | SCHEMAS, stream=st.booleans())
def test_random_numbers_and_schemas_never_get_a_5xx(served, changes, schema, stream):
    body = chat(stream=stream) | changes
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = max(1, min(body["max_tokens"], 6))
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = max(1, min(body["n"], 3))
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    r = post_json(served.url + H, body)
    if r.status_code != 200:
        assert_openai_error(r, r.status_code)
        assert 400 <= r.status_code < 500
    elif stream:
        assert "server_error" not in r.text, r.text[:300]


# ---- tools ----
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
PING = {"type": "function", "function": {"name": "ping", "description": "is the server up"}}
RESET = {"type": "function", "function": {"name": "reset", "parameters": {"type": "object", "properties": {}}}}


def save_char_folder(path, seed: int = 0):
    """A tiny model whose tokens are the printable characters: it can write JSON (the word-level
    tiny tokenizer has no '{')."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from helpers import tiny_llama

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<unk>": 0, "</s>": 1} | {c: i + 2 for i, c in enumerate(chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tiny_llama(seed, vocab=len(vocab), eos=1).save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served_chars(tmp_path_factory):
    folder = save_char_folder(tmp_path_factory.mktemp("chars") / "chars")
    s = Served(speculant.load(str(folder), drafter="ngram", device="cpu", dtype="float32"))
    yield s
    s.close()


def test_tool_choice_required_and_named_give_tool_calls(served_chars):
    pytest.importorskip("lmformatenforcer")
    url = served_chars.url + H
    for tools, choice, names, finish in (([PING, RESET], "required", {"ping", "reset"}, "tool_calls"),
                                         ([WEATHER, PING], {"type": "function", "function": {"name": "ping"}},
                                          {"ping"}, "stop")):
        body = chat(model="tiny", messages=[{"role": "user", "content": "call a tool"}], tools=tools,
                    tool_choice=choice, max_tokens=80, temperature=0)
        r = post_json(url, body)
        assert r.status_code == 200, r.text[:300]
        choice0 = r.json()["choices"][0]
        msg = choice0["message"]
        assert msg["content"] is None and len(msg["tool_calls"]) == 1, choice0
        call = msg["tool_calls"][0]
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        assert json.loads(call["function"]["arguments"]) == {} and choice0["finish_reason"] == finish, choice0
        # streamed: the same call, whole in its last chunk
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as st_:
            chunks = [json.loads(line[6:]) for line in st_.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        last = chunks[-1]["choices"][0]
        assert last["finish_reason"] == finish and last["delta"]["tool_calls"][0]["index"] == 0
        assert last["delta"]["tool_calls"][0]["function"]["name"] == call["function"]["name"]
    # a function with parameters: arguments that follow them (or the output cut short by max_tokens)
    body = chat(messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "weather"}}, max_tokens=120, temperature=0)
    choice0 = post_json(url, body).json()["choices"][0]
    call = choice0["message"]["tool_calls"][0]["function"]
    if choice0["finish_reason"] == "stop":
        assert isinstance(json.loads(call["arguments"])["city"], str)
    else:
        assert choice0["finish_reason"] == "length" and call["arguments"].startswith("{")


def test_tool_choice_none_answers_in_text(served):
    r = post_json(served.url + H, chat(tools=[WEATHER], tool_choice="none"))
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"], r.text[:300]


def test_a_conversation_with_tool_calls_and_answers_renders(served):
    messages = [{"role": "user", "content": "w5"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                        "function": {"name": "weather",
                                                                                     "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "w7"}]
    r = post_json(served.url + H, chat(messages=messages))
    assert r.status_code == 200, r.text[:300]


# ---- files that are not regular files ----
@pytest.fixture(scope="module")
def special(tmp_path_factory):
    root = tmp_path_factory.mktemp("special")
    fifo = root / "pipe.gguf"
    os.mkfifo(fifo)
    gguf = pytest.importorskip("gguf")
    whole = root / "whole.gguf"
    w = gguf.GGUFWriter(str(whole), "llama")
    w.add_tensor("token_embd.weight", torch.zeros(64, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = whole.read_bytes()
    cut = root / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    header = root / "header.gguf"
    header.write_bytes(data[:30])
    return {"fifo": str(fifo), "cut": str(cut), "header": str(header), "dir": root}


SPECIAL = ["fifo", "/dev/zero", "/dev/null", "/proc/self/mem", "a" * 10000, "/" + "b" * 300 + "/x", "cut", "header",
           "\x00nul"]


@pytest.mark.parametrize("name", SPECIAL, ids=lambda s: s[:20])
def test_special_files_are_one_line_in_the_api_at_once(special, folder, gen, name):
    path = special.get(name, name)
    for call in (lambda: speculant.load(path, dtype="float32", device="cpu"),
                 lambda: speculant.load(str(folder), drafter=f"model:{path}", dtype="float32", device="cpu")):
        t0 = time.monotonic()
        with pytest.raises(SpeculantError) as e:
            call()
        said = str(e.value)
        assert "\n" not in said and len(said) < 600 and time.monotonic() - t0 < 1.0, said
        assert not any(leak in said for leak in LEAKS), said


@pytest.mark.parametrize("flags", [["--json-schema", "/dev/zero"], ["--json-schema", "fifo"], ["--target", "fifo"],
                                   ["--target", "cut"], ["--target", "a" * 10000], ["--drafter", "model:fifo"],
                                   ["--json-schema", "/proc/self/mem"], ["--drafter", "eagle+ngram+ngram"]],
                         ids=lambda f: " ".join(f)[:30])
def test_special_files_are_one_line_in_the_cli_at_once(special, folder, capsys, flags):
    from speculant.cli import main

    flags = [special.get(f, f.replace("fifo", special["fifo"])) for f in flags]
    args = ["generate", "w5 w6", *flags] + ([] if "--target" in flags else ["--target", str(folder)])
    t0 = time.monotonic()
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert time.monotonic() - t0 < 1.0


def test_a_large_or_deep_schema_file_is_refused_before_the_model_loads(tmp_path, capsys):
    from speculant.cli import main

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"enum": ["x" * 100] * 2000}))
    for path, words in ((deep, "nested"), (big, "larger than")):
        code = main(["generate", "w5", "--target", "/no/such", "--json-schema", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


SPECS = st.lists(st.sampled_from(["eagle", "medusa", "ngram", "+ngram", "cascade:", ",", "model:", "layerskip", ":",
                                  "trained:", "suffix", "none", "x", "/tmp", "+"]), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(spec=st.one_of(SPECS, st.text(max_size=30), st.just("eagle+ngram" * 500)))
def test_drafter_specs_of_any_shape_are_refused_or_parsed_at_once(spec):
    from speculant.drafters.registry import check_spec, parse_spec

    t0 = time.monotonic()
    try:
        parse_spec(spec)
        check_spec(spec)
    except SpeculantError as e:
        assert "\n" not in str(e) and len(str(e)) < 2000
    assert time.monotonic() - t0 < 0.5, spec


# ---- the body guard, linear in chunks ----
def test_the_body_guard_counts_a_body_of_200000_chunks_in_linear_time(served):
    import asyncio

    from speculant.server.app import Guard

    async def inner(scope, receive, send):
        message = await receive()
        assert len(message["body"]) == 200_000

    async def run(chunks: int):
        guard = Guard(inner, served.app.state.server)
        messages = iter([{"type": "http.request", "body": b"x", "more_body": i < chunks - 1} for i in range(chunks)])

        async def receive():
            return next(messages)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        t0 = time.perf_counter()
        await guard(scope, receive, None)
        return time.perf_counter() - t0

    seconds = asyncio.run(run(200_000))
    assert seconds < 1.0, seconds  # recounting the body at every chunk: ~20 billion additions


# ---- JSON schemas prepared off the engine ----
def test_a_schema_past_its_time_limit_is_refused_and_its_worker_ends(gen, monkeypatch):
    pytest.importorskip("lmformatenforcer")
    from speculant import constrain, schema_worker

    def slow(self, prompt):  # a schema whose first state takes 30 s of pure Python
        end = time.monotonic() + 30
        while time.monotonic() < end:
            pass

    monkeypatch.setattr(constrain.SchemaProcessor, "prepare", slow)
    monkeypatch.setattr(schema_worker, "_HOSTS", {})  # parsers forked from a host that has the patch
    s = Served(gen, schema_seconds=0.5)
    try:
        t0 = time.monotonic()
        r = post_json(s.url + H, chat(response_format={"type": "json_object"}))
        assert_openai_error(r, 400, "longer than 0.5 s")
        assert time.monotonic() - t0 < 3
        end = time.monotonic() + 5  # the parser's process ends at its alarm (1.5 s of CPU)
        while schema_worker.workers() and time.monotonic() < end:
            time.sleep(0.05)
        assert not schema_worker.workers()
    finally:
        s.close()


def test_a_slow_schema_does_not_delay_a_request_running_meanwhile(gen, monkeypatch):
    """The schema's preparation (3 s of pure Python here) runs in a worker while the engine goes on:
    a request running meanwhile finishes about as fast as alone (before, the first state was built
    on the engine, and every request waited for it)."""
    pytest.importorskip("lmformatenforcer")
    from speculant import constrain, schema_worker

    s = Served(gen)
    body = completion(max_tokens=48, prompt="w5 w6 w7 w8", speculate=False)
    try:
        alone = []
        for _ in range(3):
            t0 = time.monotonic()
            assert post_json(s.url + C, body).status_code == 200
            alone.append(time.monotonic() - t0)
        usual = sorted(alone)[1]
        prepare = constrain.SchemaProcessor.prepare

        def slow(self, prompt):
            end = time.monotonic() + 3
            while time.monotonic() < end:
                sum(range(1000))
            prepare(self, prompt)

        monkeypatch.setattr(constrain.SchemaProcessor, "prepare", slow)
        monkeypatch.setattr(schema_worker, "_HOSTS", {})  # parsers forked from a host that has the patch
        done = {}
        worker = threading.Thread(target=lambda: done.setdefault("r", post_json(s.url + H, chat(
            response_format={"type": "json_object"}, max_tokens=8))))
        worker.start()
        time.sleep(0.3)  # the schema is being prepared
        t0 = time.monotonic()
        assert post_json(s.url + C, body).status_code == 200
        meanwhile = time.monotonic() - t0
        worker.join()
        # this word-level tokenizer has no '{': the request is refused mid-output (before, it wrote
        # whatever an all -inf mask let through); what matters here is the other request's time
        assert done["r"].status_code == 422 and "cannot be followed" in done["r"].text, done["r"].text[:300]
        print(f"\nalone {usual:.2f} s, while a schema is prepared {meanwhile:.2f} s")
        assert meanwhile < 2 * usual + 0.2, (usual, meanwhile)
    finally:
        s.close()


# ---- third round: raw errors, unbounded or silent CLI, settings taken at face value, the kernels' name ----
def test_a_lone_surrogate_echoed_into_an_error_is_escaped_not_a_500(served):
    from speculant.server.responses import error_body

    json.dumps(error_body(400, "model '\ud800'", "\udfff"), ensure_ascii=False).encode("utf-8")  # sendable
    for path, body, status in (
            (C, completion(model="\ud800"), 404), (H, chat(model="a\udfffb"), 404),
            (H, chat(tools=[{"type": "function", "function": {"name": "\ud800"}}], tool_choice="required"), 400),
            (H, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                     tool_choice={"type": "function", "function": {"name": "\ud800"}}), 400),
            (H, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "\ud800"}}}), None)):
        r = post_json(served.url + path, body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text[:300])
        err = assert_openai_error(r, status or r.status_code)
        if status == 404:  # the name as sent, its surrogate escaped
            assert "\\ud800" in err["message"] or "\\udfff" in err["message"], err


def test_the_api_docs_need_the_key_when_one_is_set(gen):
    s = Served(gen, api_key="sekrit")
    try:
        for path in ("/docs", "/openapi.json", "/redoc", "/v1/models"):
            assert_openai_error(httpx.get(s.url + path, timeout=10), 401, "API key")
            ok = httpx.get(s.url + path, headers={"Authorization": "Bearer sekrit"}, timeout=10)
            assert ok.status_code == 200, (path, ok.text[:200])
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200  # probes need no key
    finally:
        s.close()


@pytest.mark.parametrize("key", ["", "   ", " key", "kéy"])
def test_an_empty_or_unsendable_api_key_is_refused(gen, capsys, key):
    from speculant.cli import main
    from speculant.server.app import create_app

    with pytest.raises(SpeculantError, match="--api-key"):
        create_app(gen, "tiny", api_key=key)
    t0 = time.monotonic()
    code = main(["serve", "--api-key", key, "--target", "/no/such/model"])
    err = capsys.readouterr().err
    assert code == 2 and "--api-key" in err and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - t0 < 1.0


def test_a_config_json_that_is_no_object_is_one_line(tmp_path, capsys):
    from speculant.cli import main

    for name, text, words in (("list", "[1, 2]", "JSON list"), ("deep", "[" * 100_000 + "]" * 100_000, "nested"),
                              ("bad", "{", "not valid JSON"), ("deep-dict", '{"a": ' * 100_000 + "1" + "}" * 100_000,
                                                              "nested")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        with pytest.raises(SpeculantError, match=words) as e:
            speculant.load(str(folder), device="cpu", dtype="float32")
        assert "config.json" in str(e.value) and "\n" not in str(e.value)
        code = main(["generate", "w5", "--target", str(folder)])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    from speculant.trained.format import read_config

    with pytest.raises(SpeculantError, match="nested too deeply"):  # a trained drafter's folder
        read_config(tmp_path / "deep")


def _nested_gguf(path, depth: int):
    """A GGUF whose one metadata value is arrays nested ``depth`` deep (written by hand: gguf's writer
    does not nest), and no tensors."""
    import struct

    data = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 3) + b"key" + struct.pack("<I", 9)
    data += struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)
    path.write_bytes(data)
    return path


def test_gguf_metadata_arrays_nested_deep_are_one_line(tmp_path, capsys):
    import mmap

    from speculant.cli import main
    from speculant.models import gguf_model, loading
    from speculant.models.gguf_file import GGUFTable, _gguf_table, incomplete

    shallow = _nested_gguf(tmp_path / "shallow.gguf", 3)  # nested arrays llama.cpp may write: stepped over
    size = shallow.stat().st_size
    with open(shallow, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert _gguf_table(GGUFTable(m, size), incomplete(shallow, size))[1] == []
    deep = _nested_gguf(tmp_path / "deep.gguf", 100_000)
    with pytest.raises(SpeculantError, match="nested more than 16 deep") as e:
        loading.check_gguf(deep)
    assert "deep.gguf" in str(e.value) and "'key'" in str(e.value) and "\n" not in str(e.value)
    assert gguf_model.architecture(deep) is None
    for dtype in ("float32", "q8"):
        with pytest.raises(SpeculantError, match="nested"):
            speculant.load(str(deep), device="cpu", dtype=dtype)
    code = main(["generate", "w5", "--target", str(deep)])
    err = capsys.readouterr().err
    assert code == 2 and "nested" in err and len(err.strip().splitlines()) == 1, err


def _only(*allowed):
    def only(ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[list(allowed)] = logits[list(allowed)]
        return out
    return only


def returns_none(ids, logits):
    return None


@pytest.mark.parametrize("fn, words", [
    (returns_none, "returns_none returned None"),
    (lambda ids, logits: logits[:5], r"returned a float32 tensor of shape \[5\]"),
    (lambda ids, logits: logits > 0, "returned a bool tensor"),
    (lambda ids, logits: logits.tolist(), "returned a list"),
    (lambda ids, logits: torch.full_like(logits, float("nan")), "returned NaN"),
    (lambda ids, logits: torch.full_like(logits, float("-inf")), "left no token allowed"),
], ids=["none", "shape", "dtype", "list", "nan", "all-masked"])
def test_a_logits_processors_bad_result_is_named(gen, fn, words):
    for kw in (dict(), dict(temperature=0.8, seed=1)):
        with pytest.raises(SpeculantError, match=words) as e:
            gen.generate("w5 w6 w7 w5 w6", max_new_tokens=6, logits_processors=[fn], **kw)
        assert "\n" not in str(e.value) and "logits processor" in str(e.value), str(e.value)
    out = gen.generate("w5 w6 w7 w5 w6", max_new_tokens=6)  # the generator goes on as before
    assert len(out.token_ids) == 6


def test_drafts_a_processor_refuses_lead_nowhere_it_is_asked_about(gen):
    """A position after a draft the processors refuse is never reached: all -inf there is no error
    (prompt lookup proposes tokens the processors refuse; the target never accepts them)."""
    def never_after_7(ids, logits):  # 7 is never allowed, and after it nothing is
        out = torch.full_like(logits, float("-inf")) if 7 in ids[-3:] else logits.clone()
        out[7] = float("-inf")
        return out

    def dead_after_7(ids, logits):  # 7 allowed, nothing after it: a processor's bug
        return torch.full_like(logits, float("-inf")) if ids[-1] == 7 else logits

    texts = [[1, 2], [1, 2, 7], [1, 2, 7, 8]]
    logits = torch.randn(1, 3, 96)
    ctx = Context(None, None, texts)
    LogitsProcessing(SamplingParams(logits_processors=[never_after_7]), 96).scores(logits, ctx)
    with pytest.raises(SpeculantError, match="no token allowed after 3 tokens"):
        LogitsProcessing(SamplingParams(logits_processors=[dead_after_7]), 96).scores(logits, ctx)
    # through the engine: prompt lookup drafts the repeated 7s, which the processor refuses
    prompt = "w5 w7 w6 w5 w7 w6 w5 w7 w6 w5"
    plain = gen.generate(prompt, max_new_tokens=12, gamma=4, logits_processors=[never_after_7])
    assert 7 not in plain.token_ids and plain.token_ids
    only = gen.generate(prompt, max_new_tokens=8, logits_processors=[_only(5, 6)])
    assert set(only.token_ids) <= {5, 6} and len(only.token_ids) == 8


def test_chat_template_is_read_as_a_yes_or_no(gen):
    on, off = gen.encode("w5 w6", True), gen.encode("w5 w6", False)
    assert on != off
    for value, want in (("false", off), ("FALSE", off), ("no", off), ("0", off), (0, off), ("true", on),
                        (" Yes ", on), ("1", on), (1, on)):
        assert gen.encode("w5 w6", value) == want, value
    for value in ("maybe", "", None, 2, [True]):
        with pytest.raises(SpeculantError, match="chat_template must be true or false"):
            gen.generate("w5 w6", max_new_tokens=2, chat_template=value)


def test_a_device_index_that_does_not_exist_is_refused(folder, capsys):
    from speculant.cli import main

    for device in ("cpu:99", "cpu:1", torch.device("cpu", 3)):
        with pytest.raises(SpeculantError, match="does not exist"):
            speculant.load(str(folder), device=device, dtype="float32")
    assert speculant.load(str(folder), device="cpu:0", dtype="float32").engine.device.type == "cpu"
    code = main(["generate", "w5", "--target", str(folder), "--device", "cpu:99"])
    err = capsys.readouterr().err
    assert code == 2 and "cpu:99" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["check", "bench"])
def test_prompt_files_that_are_not_regular_or_too_large_are_one_line_at_once(special, tmp_path, capsys, command):
    from speculant.cli import main

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(65 << 20)  # sparse: past either command's limit, no disk taken
    deep = tmp_path / "deep.jsonl"
    deep.write_text("{" + '"a": {' * 100_000 + "}" * 100_001 + "\n")
    for path, words in (("/dev/zero", "character device"), (special["fifo"], "FIFO"), (str(big), "larger than"),
                        (str(tmp_path / "none.txt"), "does not exist"), (str(special["dir"]), "folder"),
                        (str(deep), "deep.jsonl")):
        t0 = time.monotonic()
        code = main([command, "--prompts", path, "--target", "/no/such/model"])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (path, err)
        assert "Traceback" not in err and time.monotonic() - t0 < 1.0, path


def test_an_out_path_that_cannot_be_written_is_refused_before_the_work(special, tmp_path, capsys):
    from speculant.cli import main

    for out, words in (("/proc/x", "cannot write '/proc/x'"), ("/dev/null", "not a regular file"),
                       (special["fifo"], "not a regular file"), (str(tmp_path), "is a folder")):
        t0 = time.monotonic()
        code = main(["tune-layerskip", "--target", "/no/such/model", "--out", out])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (out, err)
        assert time.monotonic() - t0 < 1.0
    code = main(["bench", "--target", "/no/such/model", "--peers", "none", "--out", "/proc/x"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot write" in err, err


def test_the_kernels_name_differs_by_configuration_and_only_by_it(monkeypatch):
    """Each build configuration gets a name (a folder) of its own, so configurations used in turn
    never replace one another's module (and rebuild); the same one always the same name. Nothing is
    compiled here."""
    from speculant.models import native

    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx512f", "avx2", "fma"})  # every ISA flag counts
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    monkeypatch.delenv("CXX", raising=False)

    def name() -> str:
        return native.module_name(native.FLAGS + native.build_flags())

    first = name()
    assert name() == first and first.startswith("speculant_kernels_")
    names = {first}
    for isa in ("avx2", "generic"):
        monkeypatch.setenv(native.ISA_ENV, isa)
        names.add(name())
        assert name() in names  # stable under the same setting
    monkeypatch.setenv(native.ISA_ENV, "native")
    assert name() == first
    assert native.module_name(native.FLAGS + native.build_flags(("-mno-avx2",))) not in names
    monkeypatch.setenv("CXX", "clang++-that-is-not-here")
    names.add(name())
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(native, "_vendor_flags", lambda: ("-DSPK_CPU_OTHER_VENDOR",))  # another define
    names.add(name())
    monkeypatch.undo()
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx512f", "avx2", "fma"})
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(sys, "version", sys.version + " (another build)")
    names.add(name())
    names.add(native.module_name(native.FLAGS + native.build_flags(), source="other sources"))
    assert len(names) == 7, names

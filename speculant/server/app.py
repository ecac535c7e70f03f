"""An OpenAI-compatible HTTP server over one Generator (FastAPI).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming by server-sent events or
not), GET /v1/models, GET /health, GET /metrics (Prometheus text), GET / (the playground page).
Errors have OpenAI's body: {"error": {"message", "type", "param", "code"}}.

Beyond OpenAI's fields a request may carry ``gamma``, ``top_k``, ``min_p`` and
``repetition_penalty``; every streamed choice carries ``speculant.tokens``: each new token's text
and whether it was a draft token the target accepted (``draft: true``) or the target's own; a
non-streamed response carries ``speculant`` stats (α, τ, passes). OpenAI clients ignore both.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import TextStream
from ..errors import SpeculantError
from ..limits import check_stop, check_text
from ..sampling import LogitsProcessing, SamplingParams, row_seed
from .metrics import Metrics
from .requests import ChatRequest, CompletionRequest, Sampling, validation_message
from .scheduler import BATCH_SETTINGS, Job, QueueFull, Scheduler

log = logging.getLogger("speculant.server")

DEFAULT_MAX_TOKENS = 1024  # for a chat request that names no max_tokens
MAX_BODY_BYTES = 4 * 2**20  # a request body's most bytes by default (--max-body-mib): far more than a context of text
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "abort": "abort"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": None}}


def create_app(generator, model_name: str = "default", api_key: str | None = None, max_batch_size: int = 32,
               max_queue: int = 256, request_timeout: float = 600.0, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's app; its scheduler (one owner thread for the engine) starts now and stops with the app.
    A request may use ``generator.memory_budget`` bytes of caches, and send ``max_body_bytes`` of body."""
    state = {}

    def start():
        sched = Scheduler(generator, max_batch_size, max_queue)
        metrics = Metrics(sched.queue_depth, sched.batch_size)
        sched.on_done, sched.on_pass = metrics.record_done, metrics.record_pass
        state.update(scheduler=sched, metrics=metrics)

    start()

    async def lifespan(app):
        yield
        state["scheduler"].close()

    app = FastAPI(title="speculant", lifespan=lifespan)
    app.state.speculant = state
    tok = generator.tokenizer
    context = generator.target.context_length

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error(request, e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        model = CompletionRequest if request.url.path.endswith("/completions") and "chat" not in request.url.path \
            else ChatRequest
        message, param = validation_message(e.errors(), model)
        return _error(request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        if e.status_code == 400:  # Starlette's "There was an error parsing the body" (JSON nested too deep, say)
            return _error(request, 400, "the request body could not be read as JSON: send one JSON object")
        return _error(request, e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):  # never a library's text, never a bare 500
        log.exception("request to %s failed", request.url.path)
        return _error(request, 500, "internal error: the server's log has the details")

    def _error(request: Request, status: int, message: str, param: str | None = None):
        state["metrics"].requests.labels(request.url.path, str(status)).inc()
        return JSONResponse(error_body(status, message, param), status_code=status)

    class _Guard:
        """The API key check and the body size limit, as plain ASGI: an ``@app.middleware`` wraps
        the request's receive channel, and the endpoint then never hears that a client has gone."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            request = Request(scope)
            if api_key and scope["path"].startswith("/v1/") and not _authorized(request.headers.get("authorization")):
                why = "missing API key" if not request.headers.get("authorization") else "wrong API key"
                response = _error(request, 401, f"{why}: send 'Authorization: Bearer <key>' with the server's --api-key")
                return await response(scope, receive, send)
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_body_bytes:  # refused before a byte of it is read
                return await _too_large(request)(scope, receive, send)
            if scope["method"] in ("POST", "PUT", "PATCH"):  # chunked bodies: count as they come
                body, more = [], True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body.append(message.get("body", b""))
                    more = message.get("more_body", False)
                    if sum(map(len, body)) > max_body_bytes:
                        return await _too_large(request)(scope, receive, send)
                receive = _replay(b"".join(body), receive)
            await self.inner(scope, receive, send)

    def _authorized(given: str | None) -> bool:
        scheme, _, key = (given or "").strip().partition(" ")
        # HTTP schemes are case-insensitive; a constant-time comparison tells nothing of how much matched
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode())

    def _too_large(request: Request):
        return _error(request, 413, f"the request body is larger than this server takes ({max_body_bytes:,} bytes, "
                                    "--max-body-mib): send a shorter prompt")

    app.add_middleware(_Guard)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queue_depth": state["scheduler"].queue_depth()}

    @app.get("/metrics")
    async def metrics():
        return Response(state["metrics"].text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "speculant"}]}

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return resources.files("speculant.server").joinpath("playground.html").read_text(encoding="utf-8")

    # tokenising, chat templates and JSON-schema tables take long for long inputs: they run in a
    # worker thread, so the event loop goes on answering other requests (and /health) meanwhile
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        if body.echo:
            raise ApiError(400, "echo is not supported: leave it false", "echo")
        prompts = await asyncio.to_thread(_completion_prompts, body.prompt)
        return await _serve(request, body, prompts, chat=False, logprobs=body.logprobs, max_tokens=body.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model)
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, f"model '{model_name}' has no chat template: use /v1/completions", "messages")
        messages = [{"role": m.role, "content": _text_content(m.content, f"messages.{i}.content")}
                    for i, m in enumerate(body.messages)]
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        ids = await asyncio.to_thread(_chat_prompt, messages)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await _serve(request, body, [ids], chat=True, logprobs=logprobs,
                            max_tokens=body.max_completion_tokens or body.max_tokens)

    def _chat_prompt(messages: list[dict]) -> list[int]:
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a template that rejects these roles or this order says so in its own words
            from jinja2 import TemplateError

            if isinstance(e, TemplateError) and str(e) and "\n" not in str(e) and len(str(e)) < 300:
                raise ApiError(400, f"the chat template rejected these messages: {e}", "messages") from None
            log.exception("the chat template failed")
            raise ApiError(400, "the chat template could not render these messages: check their roles and "
                                "order", "messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _check_model(name: str):
        if name != model_name:
            raise ApiError(404, f"model '{name}' is not served here: this server serves '{model_name}' "
                                "(GET /v1/models)", "model")

    def _completion_prompts(prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt is empty: give some text", "prompt")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        out = []
        for p in prompt:
            ids = list(tok(_checked_text(p, "prompt"), add_special_tokens=True)["input_ids"]) if isinstance(p, str) \
                else list(p)
            if not ids:
                raise ApiError(400, "prompt is empty: give some text", "prompt")
            if any(t < 0 or t >= generator.target.vocab_size for t in ids):
                raise ApiError(400, f"prompt token ids must be in 0..{generator.target.vocab_size - 1}", "prompt")
            out.append(ids)
        return out

    def _sampling(body: Sampling, logprobs: int | None) -> dict:
        settings = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                        frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias or None)
        try:  # checked here, not in the batch: one request's bad bias must not fail the others
            LogitsProcessing(SamplingParams(**settings), generator.target.vocab_size)
        except SpeculantError as e:
            raise ApiError(400, str(e), "top_k" if "top-k" in str(e) else "logit_bias" if body.logit_bias else None) \
                from None
        try:
            gamma = generator.check_gamma(body.gamma) if body.gamma is not None else None
        except SpeculantError as e:  # beyond what this drafter's proposals hold
            raise ApiError(400, str(e), "gamma") from None
        return settings | {"logprobs": logprobs, "gamma": gamma, "speculate": body.speculate}

    def _format_processor(fmt: dict):
        from ..constrain import json_schema_processor

        kind = fmt.get("type")
        if kind == "json_object":
            schema = None
        elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            schema = fmt["json_schema"].get("schema", {})
        else:
            raise ApiError(400, "response_format must be {'type': 'text' | 'json_object'} or {'type': 'json_schema', "
                                "'json_schema': {'schema': {...}}}", "response_format")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON Schema object", "response_format")
        try:
            return json_schema_processor(tok, schema, generator.target.eos_token_ids)
        except SpeculantError as e:
            raise ApiError(400, f"response_format: {e}", "response_format") from None

    async def _serve(request: Request, body: Sampling, prompts: list[list[int]], chat: bool, logprobs, max_tokens):
        endpoint = request.url.path
        longest = max(len(p) for p in prompts)
        if max_tokens is None:  # the KV cache is sized by it: a bound, not the whole context
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, context - longest))
        if longest + max_tokens > context:
            raise ApiError(400, f"the prompt ({longest} tokens) plus max_tokens ({max_tokens}) is more than the "
                                f"model's context of {context} tokens: shorten the prompt or lower max_tokens",
                           "max_tokens")
        settings = _sampling(body, logprobs)
        try:
            stop = check_stop(body.stop)
            gamma = settings["gamma"] if settings["gamma"] is not None else generator.gamma
            generator.check_memory(len(prompts) * body.n, longest, max_tokens, gamma if body.speculate else 0)
        except SpeculantError as e:
            raise ApiError(400, str(e), "stop" if "stop" in str(e) else "max_tokens") from None
        fmt = getattr(body, "response_format", None)
        if fmt and fmt.get("type") not in (None, "text"):
            settings["logits_processors"] = [await asyncio.to_thread(_format_processor, fmt)]
        # requests share batches by γ setting and the forms of text their processing reads; the
        # rest of the settings are per row (a seeded choice's text is the same whatever it shares with)
        forms = SamplingParams(**{k: v for k, v in settings.items() if k not in ("logprobs", *BATCH_SETTINGS)}).forms
        group = json.dumps({"forms": forms, **{k: settings[k] for k in BATCH_SETTINGS}}, sort_keys=True)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink_for(index: int):
            def sink(event):
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the event loop is gone (server stopping)
                    pass
            return sink

        jobs = [Job(p, max_tokens, sink_for(i), stop, settings, None if body.seed is None else row_seed(body.seed, i),
                    group)
                for i, p in enumerate(p for p in prompts for _ in range(body.n))]
        sched, metrics = state["scheduler"], state["metrics"]
        if len(jobs) > sched.max_queue:  # would never fit: a 429 would have the client retry forever
            raise ApiError(400, f"{len(jobs)} completions (n x prompts) are more than this server queues at once "
                                f"(--max-queue {sched.max_queue}): ask for fewer", "n")
        try:
            sched.submit(jobs)
        except QueueFull as e:
            raise ApiError(429, str(e)) from None
        arrived = time.monotonic()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        streams = [TextStream(generator.decode, stop) for _ in jobs]

        async def next_event(poll: float | None = None):
            """The next event of the request's jobs; None after ``poll`` seconds without one."""
            left = request_timeout - (time.monotonic() - arrived)
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                return await asyncio.wait_for(events.get(), min(left, poll or left))
            except asyncio.TimeoutError:
                if poll is not None and poll < left:
                    return None
                raise

        def pieces(i: int, new) -> list[dict]:
            """Each new token's text (as the stream shows it) and where it came from."""
            return [{"text": streams[i].add([t]), "draft": k < new.from_draft} for k, t in enumerate(new)]

        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            async def sse():
                done, outputs, first, ended = 0, [None] * len(jobs), True, False
                try:
                    while done < len(jobs):
                        try:
                            i, (kind, data) = await next_event()
                        except asyncio.TimeoutError:
                            yield _sse(error_body(408, f"the request took longer than {request_timeout:g} s"))
                            metrics.requests.labels(endpoint, "408").inc()
                            ended = True
                            return
                        if kind == "error":
                            yield _sse(error_body(500, data))
                            metrics.requests.labels(endpoint, "500").inc()
                            ended = True
                            return
                        if kind == "tokens":
                            if first:
                                metrics.first_token.observe(time.monotonic() - arrived)
                                first = False
                            toks = pieces(i, data)
                            text = "".join(t["text"] for t in toks)
                            yield _sse(_chunk(rid, created, model_name, chat, i, text, None, toks))
                        else:
                            done += 1
                            outputs[i] = data
                            rest = streams[i].finish(data.text)
                            yield _sse(_chunk(rid, created, model_name, chat, i, rest, FINISH.get(data.finish_reason),
                                              [], data.logprobs, logprobs, tok, _stats([data])))
                    if include_usage:
                        yield _sse(_chunk(rid, created, model_name, chat, None, "", None, []) | {
                            "choices": [], "usage": _usage(outputs, body.n)})
                    yield "data: [DONE]\n\n"
                    ended = True
                    metrics.requests.labels(endpoint, "200").inc()
                    metrics.latency.observe(time.monotonic() - arrived)
                finally:  # a client that goes away frees its rows at the next pass
                    sched.cancel(jobs)
                    if not ended and done < len(jobs):
                        metrics.requests.labels(endpoint, "499").inc()  # the client left (nginx's code)

            return StreamingResponse(sse(), media_type="text/event-stream")

        outputs, first, checked = [None] * len(jobs), True, time.monotonic()
        try:
            while any(o is None for o in outputs):
                event = await next_event(poll=DISCONNECT_POLL)
                if time.monotonic() - checked >= DISCONNECT_POLL:  # a client that left frees its rows
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        metrics.requests.labels(endpoint, "499").inc()
                        return Response(status_code=499)
                if event is None:
                    continue
                i, (kind, data) = event
                if kind == "error":
                    raise ApiError(500, data)
                if kind == "tokens" and first:
                    metrics.first_token.observe(time.monotonic() - arrived)
                    first = False
                if kind == "done":
                    outputs[i] = data
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request took longer than {request_timeout:g} s") from None
        finally:
            sched.cancel(jobs)
        metrics.requests.labels(endpoint, "200").inc()
        metrics.latency.observe(time.monotonic() - arrived)
        choices = [_choice(chat, i, o, logprobs, tok) for i, o in enumerate(outputs)]
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": choices, "usage": _usage(outputs, body.n),
                "speculant": _stats(outputs)}

    return app


DISCONNECT_POLL = 0.25  # seconds between checks that a non-streamed request's client is still there


def _checked_text(text: str, field: str) -> str:
    try:
        return check_text(text, field)
    except SpeculantError as e:
        raise ApiError(400, str(e), field) from None


def _text_content(content, field: str) -> str:
    if content is None or isinstance(content, str):
        return _checked_text(content or "", field)
    parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    if len(parts) != len(content):
        raise ApiError(400, "only text message parts are supported", field)
    if not all(isinstance(p, str) for p in parts):
        raise ApiError(400, f"{field}: a text part's 'text' must be a string", field)
    return _checked_text("".join(parts), field)


def _replay(body: bytes, receive):
    """A receive channel that gives the app ``body`` (already read) and then listens to the client."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # http.disconnect when the client goes

    return replay


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(outputs, n: int) -> dict:
    """OpenAI's usage: each prompt's tokens once (not once for each of its ``n`` choices, which
    follow one another), every choice's completion."""
    prompt = sum(next((len(o.prompt_token_ids) for o in outputs[i : i + n] if o is not None), 0)
                 for i in range(0, len(outputs), n))
    completion = sum(len(o.token_ids) for o in outputs if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _stats(outputs) -> dict:
    """α and τ over the choices of one response (and the first choice's full stats)."""
    drafted = sum(o.stats["draft_tokens"] for o in outputs)
    accepted = sum(o.stats["accepted_draft_tokens"] for o in outputs)
    passes = sum(o.stats["target_forward_passes"] for o in outputs)
    tokens = sum(o.stats["new_tokens"] for o in outputs)
    return {"acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_accepted_tokens": round(tokens / passes, 4) if passes else 0.0,
            "target_forward_passes": passes, "drafter": outputs[0].stats["drafter"]}


def _logprobs(entries, chat: bool, tok) -> dict | None:
    if entries is None:
        return None
    name = lambda i: tok.decode([i])  # noqa: E731
    if chat:
        return {"content": [{"token": name(e["token"]), "logprob": e["logprob"],
                             "bytes": list(name(e["token"]).encode()),
                             "top_logprobs": [{"token": name(i), "logprob": v, "bytes": list(name(i).encode())}
                                              for i, v in e["top"]]} for e in entries]}
    texts = [name(e["token"]) for e in entries]
    offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{name(i): v for i, v in e["top"]} for e in entries], "text_offset": offsets}


def _choice(chat: bool, index: int, out, logprobs, tok) -> dict:
    lp = _logprobs(out.logprobs, chat, tok) if logprobs is not None else None
    finish = FINISH.get(out.finish_reason)
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                "finish_reason": finish}
    return {"index": index, "text": out.text, "logprobs": lp, "finish_reason": finish}


def _chunk(rid, created, model, chat: bool, index, text: str, finish, tokens, entries=None, logprobs=None,
           tok=None, stats=None) -> dict:
    """One server-sent event of a streamed response (a final one carries the finish reason and,
    when asked, the choice's logprobs)."""
    lp = _logprobs(entries, chat, tok) if logprobs is not None and entries is not None else None
    if chat:
        delta = {"role": "assistant", "content": text} if text or finish is None else {}
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    choice["speculant"] = {"tokens": tokens} | ({"stats": stats} if stats else {})
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}

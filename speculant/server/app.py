"""An OpenAI-compatible HTTP server over one Generator (FastAPI).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming by server-sent events or
not), GET /v1/models, GET /health, GET /metrics (Prometheus text), GET / (the playground page).
Errors have OpenAI's body: {"error": {"message", "type", "param", "code"}}.

Beyond OpenAI's fields a request may carry ``gamma``, ``top_k``, ``min_p`` and
``repetition_penalty``; every streamed choice carries ``speculant.tokens``: each new token's text
and whether it was a draft token the target accepted (``draft: true``) or the target's own; a
non-streamed response carries ``speculant`` stats (α, τ, passes). OpenAI clients ignore both.

How a request becomes tokens: a handler here parses it (``requests``), ``prepare`` turns it into
jobs (prompts, settings, checks against the model and the memory it needs, a JSON schema prepared
off the engine, ``tools`` held to their schemas), the ``Scheduler``'s engine thread batches and
decodes them within the server's one memory account, and ``streaming`` hands their events back
(``responses`` shapes them, tool calls included).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import free_memory
from ..constrain import warm
from ..errors import SpeculantError
from ..limits import SCHEMA_SECONDS, SERVER_MEMORY_SHARE
from . import prepare
from .metrics import Metrics
from .requests import ChatRequest, CompletionRequest, Sampling, validation_message
from .responses import ApiError, Reply, ToolCalls, error_body
from .scheduler import QueueFull, Scheduler
from .streaming import Call, gather, stream_events

log = logging.getLogger("speculant.server")

MAX_BODY_BYTES = 4 * 2**20  # a request body's most bytes by default (--max-body-mib): far more than a context of text
# what --api-key guards: the API, and FastAPI's pages describing it (they list every endpoint and field)
KEYED = ("/v1/", "/docs", "/redoc", "/openapi.json")
SCHEMA_WORKERS = 1  # schema preparations at once (each may take a core for schema_seconds)
MAX_SCHEMAS_WAITING = 4  # preparations queued or running; past them a request with a schema gets a 429
STALLED_SECONDS = 30.0  # /health says 503 when a batch runs and no pass of it has ended for this long


@dataclass
class Server:
    """What the handlers serve with (``app.state.server``)."""

    generator: object
    model_name: str
    scheduler: Scheduler
    metrics: Metrics
    api_key: str | None
    request_timeout: float
    max_body_bytes: int
    memory_budget: int  # bytes, for all requests together
    schema_seconds: float  # the most a JSON schema's preparation may take
    schema_pool: ThreadPoolExecutor  # where schemas are prepared: never the threads that read requests
    schemas_waiting: int = 0  # preparations queued or running there


def default_memory_budget(generator) -> int:
    """The server's memory for all its requests by default: SERVER_MEMORY_SHARE of what the machine
    can give without swapping when it starts (``api.free_memory``: available RAM, or a container's
    memory cgroup's room where less; a GPU's free memory)."""
    return int(SERVER_MEMORY_SHARE * free_memory(generator.engine.device))


def create_app(generator, model_name: str = "default", api_key: str | None = None, max_batch_size: int = 32,
               max_queue: int = 256, request_timeout: float = 600.0, max_body_bytes: int = MAX_BODY_BYTES,
               max_memory: int | None = None, schema_seconds: float = SCHEMA_SECONDS) -> FastAPI:
    """The server's app; its scheduler (one owner thread for the engine) starts now and stops with the app.
    All requests together may hold ``max_memory`` bytes (default: ``default_memory_budget``), one
    request ``generator.memory_budget`` of them; a body may be ``max_body_bytes`` long; a JSON schema
    may take ``schema_seconds`` to prepare."""
    check_api_key(api_key)
    warm(generator.tokenizer, generator.target.eos_token_ids)  # what every JSON schema's parser reads
    budget = int(max_memory) if max_memory is not None else default_memory_budget(generator)
    sched = Scheduler(generator, max_batch_size, max_queue, memory_budget=budget, request_timeout=request_timeout)
    metrics = Metrics(sched.queue_depth, sched.batch_size, lambda: sched.held, lambda: budget)
    sched.on_done, sched.on_pass = metrics.record_done, metrics.record_pass
    server = Server(generator, model_name, sched, metrics, api_key, request_timeout, max_body_bytes, budget,
                    schema_seconds, ThreadPoolExecutor(SCHEMA_WORKERS, thread_name_prefix="speculant-schema"))

    async def lifespan(app):
        yield
        sched.close()
        server.schema_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="speculant", lifespan=lifespan)
    app.state.server = server
    app.state.speculant = {"scheduler": sched, "metrics": metrics}
    for kind, handler in ((ApiError, on_api_error), (RequestValidationError, on_invalid),
                          (StarletteHTTPException, on_http_error), (Exception, on_internal_error)):
        app.add_exception_handler(kind, handler)
    app.add_middleware(Guard, server=server)
    app.get("/health")(health)
    app.get("/metrics")(metrics_text)
    app.get("/v1/models")(models)
    app.get("/", response_class=HTMLResponse)(playground)
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat)
    return app


def check_api_key(key: str | None) -> None:
    """An API key that can be sent: an empty one would turn authentication off unsaid (to serve
    without a key, give none), one with spaces around it would match no client's (they are stripped)."""
    if key is None:
        return
    if not isinstance(key, str):
        raise SpeculantError(f"the API key must be a str, got {type(key).__name__}")
    if not key.strip():
        raise SpeculantError("--api-key is empty: give a key, or leave --api-key out to serve without one")
    if key != key.strip() or not key.isprintable() or not key.isascii():
        raise SpeculantError("--api-key must be printable ASCII without spaces around it (clients send it in a header)")


def _server(request: Request) -> Server:
    return request.app.state.server


def error_response(request: Request, status: int, message: str, param: str | None = None,
                   retry_after: int | None = None) -> JSONResponse:
    _server(request).metrics.requests.labels(request.url.path, str(status)).inc()
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


# ---- errors: every one in OpenAI's body, in the request's words ----
async def on_api_error(request: Request, e: ApiError):
    return error_response(request, e.status, e.message, e.param, e.retry_after)


async def on_invalid(request: Request, e: RequestValidationError):
    model = ChatRequest if "chat" in request.url.path else CompletionRequest
    message, param = validation_message(e.errors(), model)
    return error_response(request, 400, message, param)


async def on_http_error(request: Request, e: StarletteHTTPException):
    if e.status_code == 400:  # Starlette's "There was an error parsing the body" (JSON nested too deep, say)
        return error_response(request, 400, "the request body could not be read as JSON: send one JSON object")
    return error_response(request, e.status_code, str(e.detail))


async def on_internal_error(request: Request, e: Exception):  # never a library's text, never a bare 500
    log.exception("request to %s failed", request.url.path)
    return error_response(request, 500, "internal error: the server's log has the details")


class Guard:
    """The API key check and the body size limit, as plain ASGI: an ``@app.middleware`` wraps the
    request's receive channel, and the endpoint then never hears that a client has gone."""

    def __init__(self, inner, server: Server):
        self.inner, self.server = inner, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        request, limit = Request(scope), self.server.max_body_bytes
        key = self.server.api_key
        if key and scope["path"].startswith(KEYED) and not authorized(request.headers.get("authorization"), key):
            why = "missing API key" if not request.headers.get("authorization") else "wrong API key"
            response = error_response(request, 401, f"{why}: send 'Authorization: Bearer <key>' with the server's --api-key")
            return await response(scope, receive, send)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # refused before a byte of it is read
            return await self._too_large(request)(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):  # chunked bodies: counted as they come
            body, more, size = [], True, 0
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                piece = message.get("body", b"")
                if piece:
                    body.append(piece)
                    size += len(piece)  # a running count: linear in the chunks, however many
                more = message.get("more_body", False)
                if size > limit:
                    return await self._too_large(request)(scope, receive, send)
            receive = _replay(b"".join(body), receive)
        await self.inner(scope, receive, send)

    def _too_large(self, request: Request) -> JSONResponse:
        return error_response(request, 413, f"the request body is larger than this server takes "
                                         f"({self.server.max_body_bytes:,} bytes, --max-body-mib): send a shorter prompt")


def authorized(given: str | None, api_key: str) -> bool:
    """``Authorization: Bearer KEY``: the scheme in any case (HTTP's rule), the key compared in
    constant time (how much of it matched is not told by the time taken)."""
    scheme, _, key = (given or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode())


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


# ---- endpoints ----
async def health(request: Request):
    s = _server(request)
    if s.scheduler.stalled(STALLED_SECONDS):
        return JSONResponse({"status": "stalled", "model": s.model_name, "queue_depth": s.scheduler.queue_depth(),
                             "detail": f"no pass of the engine has ended for over {STALLED_SECONDS:g} s"},
                            status_code=503)
    return {"status": "ok", "model": s.model_name, "queue_depth": s.scheduler.queue_depth()}


async def metrics_text(request: Request):
    return Response(_server(request).metrics.text(), media_type="text/plain; version=0.0.4")


async def models(request: Request):
    return {"object": "list", "data": [{"id": _server(request).model_name, "object": "model",
                                        "created": int(time.time()), "owned_by": "speculant"}]}


async def playground():
    return resources.files("speculant.server").joinpath("playground.html").read_text(encoding="utf-8")


# tokenising, chat templates and JSON-schema tables take long for long inputs: they run in a worker
# thread, so the event loop goes on answering other requests (and /health) meanwhile
async def completions(body: CompletionRequest, request: Request):
    s = _server(request)
    _check_model(s, body.model)
    if body.echo:
        raise ApiError(400, "echo is not supported: leave it false", "echo")
    prompts = await asyncio.to_thread(prepare.completion_prompts, s.generator, body.prompt)
    return await serve(request, body, prompts, chat=False, logprobs=body.logprobs, max_tokens=body.max_tokens)


async def chat(body: ChatRequest, request: Request):
    s = _server(request)
    _check_model(s, body.model)
    if not getattr(s.generator.tokenizer, "chat_template", None):
        raise ApiError(400, f"model '{s.model_name}' has no chat template: use /v1/completions", "messages")
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    # the tools' schemas are checked keyword by keyword (a pattern's automaton built): off the event
    # loop, on the schema pool, within the schema time limit
    plan = await _on_schema_pool(s, "tools", _tool_plan, body, s.schema_seconds) if body.tools \
        else prepare.tool_plan(body)
    messages, tools = prepare.message_texts(body), None
    if plan is not None:
        messages, tools = prepare.tool_messages(s.generator, body, messages, plan)
    ids = await asyncio.to_thread(prepare.chat_prompt, s.generator, messages, tools)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await serve(request, body, [ids], chat=True, logprobs=logprobs,
                       max_tokens=body.max_completion_tokens or body.max_tokens, tools=plan)


def _tool_plan(body: ChatRequest, seconds: float) -> ToolCalls | None:
    from ..constrain import within

    try:
        return within(seconds, lambda: prepare.tool_plan(body), "the tools' parameter schemas")
    except SpeculantError as e:  # past the time limit
        raise ApiError(400, str(e), "tools") from None


def _check_model(s: Server, name: str) -> None:
    if name != s.model_name:
        raise ApiError(404, f"model '{name}' is not served here: this server serves '{s.model_name}' "
                            "(GET /v1/models)", "model")


def _format(body: Sampling, tools: ToolCalls | None) -> tuple[dict | None, str]:
    """The JSON schema the output is held to, as a response_format, and the field that asked for it."""
    if tools is not None:
        return {"type": "json_schema", "json_schema": {"schema": tools.schema}}, "tools"
    fmt = body.response_format
    return (fmt if fmt and fmt.get("type") not in (None, "text") else None), "response_format"


async def _on_schema_pool(s: Server, field: str, fn, *args):
    """``fn(*args)`` (a schema's preparation, the tools' schemas checked) on the server's own small
    pool (one at a time, at most MAX_SCHEMAS_WAITING queued: past them a 429 at once), so that slow
    schemas hold neither the threads that read other requests nor one another's clients for long."""
    if s.schemas_waiting >= MAX_SCHEMAS_WAITING:
        raise ApiError(429, f"{s.schemas_waiting} JSON schemas are being prepared: retry in a few seconds",
                       field, retry_after=int(s.schemas_waiting * s.schema_seconds) + 1)
    s.schemas_waiting += 1  # the event loop's thread alone counts
    try:
        return await asyncio.get_running_loop().run_in_executor(s.schema_pool, fn, *args)
    finally:
        s.schemas_waiting -= 1


async def serve(request: Request, body: Sampling, prompts: list[list[int]], chat: bool, logprobs, max_tokens,
                tools: ToolCalls | None = None):
    """Check the request against the model and the memory it would need, prepare its schema off the
    engine, queue its jobs, and answer: streamed or whole."""
    s = _server(request)
    gen = s.generator
    max_tokens = prepare.token_budget(gen, prompts, max_tokens)
    settings = prepare.sampling_settings(gen, body, logprobs)
    fmt, field = _format(body, tools)
    stop, need, extra = prepare.check_request(gen, body, prompts, max_tokens, settings, logprobs, fmt is not None,
                                              s.memory_budget)
    if fmt is not None:  # built and its first states computed in a worker, stopped at its time limit
        settings["logits_processors"] = [await _on_schema_pool(s, field, prepare.format_processor, s.generator, fmt,
                                                               prompts, s.schema_seconds, field)]
    choices = len(prompts) * body.n
    call = Call(gen.decode, stop, choices, s.request_timeout, s.metrics, request.url.path)
    jobs = prepare.make_jobs(body, prompts, max_tokens, stop, settings, call.sink_for, extra)
    if len(jobs) > s.scheduler.max_queue:  # would never fit: a 429 would have the client retry forever
        raise ApiError(400, f"{len(jobs)} completions (n x prompts) are more than this server queues at once "
                            f"(--max-queue {s.scheduler.max_queue}): ask for fewer", "n")
    try:
        s.scheduler.submit(jobs, need)
    except QueueFull as e:
        raise ApiError(429, str(e), retry_after=e.retry_after) from None
    reply = Reply(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()), s.model_name, chat,
                  gen.tokenizer, logprobs, tools)
    cancel = lambda: s.scheduler.cancel(jobs)  # noqa: E731
    if body.stream:
        include_usage = bool(body.stream_options is not None and body.stream_options.include_usage)
        return StreamingResponse(stream_events(call, reply, choices, body.n, include_usage, cancel),
                                 media_type="text/event-stream")
    outputs = await gather(call, choices, cancel, request.is_disconnected)
    if outputs is None:
        return Response(status_code=499)
    return reply.whole(outputs, body.n)

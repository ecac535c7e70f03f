"""How a request becomes the engine's work: prompts (tokenised, or through the chat template),
sampling settings checked against the model, a JSON-schema processor, and the checks that need
the model (context, memory, the drafter's largest γ). Plain functions of the request and the
Generator: each testable without HTTP. Raise ``ApiError`` with the field at fault."""
from __future__ import annotations

import json
import logging

from ..errors import SpeculantError
from ..limits import SCHEMA_SECONDS, check_stop, check_text, gib
from ..sampling import LogitsProcessing, SamplingParams, row_seed
from .requests import ChatRequest, Sampling
from .responses import ApiError, ToolCalls
from .scheduler import BATCH_SETTINGS, Job

log = logging.getLogger("speculant.server")

DEFAULT_MAX_TOKENS = 1024  # for a chat request that names no max_tokens


def checked_text(text: str, field: str) -> str:
    try:
        return check_text(text, field)
    except SpeculantError as e:
        raise ApiError(400, str(e), field) from None


def completion_prompts(generator, prompt) -> list[list[int]]:
    """A completions request's prompts as token ids: text is tokenised, ids are checked."""
    tok, vocab = generator.tokenizer, generator.target.vocab_size
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty: give some text", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        ids = list(tok(checked_text(p, "prompt"), add_special_tokens=True)["input_ids"]) if isinstance(p, str) \
            else list(p)
        if not ids:
            raise ApiError(400, "prompt is empty: give some text", "prompt")
        if any(t < 0 or t >= vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        out.append(ids)
    return out


def message_texts(body: ChatRequest) -> list[dict]:
    """The chat messages as the template takes them: text, and an assistant's tool calls and a tool's
    answer where they have them."""
    out = []
    for i, m in enumerate(body.messages):
        msg = {"role": m.role, "content": text_content(m.content, f"messages.{i}.content")}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


NO_ARGUMENTS = {"type": "object", "properties": {}}


def tool_plan(body: ChatRequest) -> ToolCalls | None:
    """How this request's ``tools`` are called (``tool_choice``): "required" or a named function:
    the output is held to the tools' JSON schemas and returned as ``tool_calls``; "none": the model
    answers in text. "auto" (the default where tools are sent) is refused: which free-text answers
    are tool calls depends on each model's own format, and this server does not guess it."""
    extra = body.model_extra or {}
    for legacy in ("functions", "function_call"):
        if legacy in extra:
            raise ApiError(400, f"{legacy} is OpenAI's deprecated form: send tools and tool_choice", legacy)
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools: send the functions in tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise ApiError(400, "tool_choice 'auto' (the default where tools are sent) is not supported: this server "
                            "calls tools when told to: send tool_choice 'required' or {'type': 'function', "
                            "'function': {'name': ...}}, or 'none'", "tool_choice")
    fmt = body.response_format
    if fmt and fmt.get("type") not in (None, "text"):
        raise ApiError(400, "response_format cannot be combined with a tool call (its arguments follow the "
                            "function's parameters): send one of them", "response_format")
    functions = {}
    for i, t in enumerate(body.tools):
        if t.function.name in functions:
            raise ApiError(400, f"tools.{i}: a second function named '{t.function.name}'", "tools")
        functions[t.function.name] = tool_parameters(t.function.parameters or NO_ARGUMENTS, i)
    if choice == "required":
        # each function's parameters sit below the root now: their own $refs ("#/$defs/X") point there
        bases = ["#/properties/arguments"] if len(functions) == 1 else \
            [f"#/anyOf/{i}/properties/arguments" for i in range(len(functions))]
        schemas = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                     "arguments": rebased(params, base)},
                    "required": ["name", "arguments"]} for (name, params), base in zip(functions.items(), bases)]
        return ToolCalls("required", list(functions), schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    name = choice.function.name
    if name not in functions:
        raise ApiError(400, f"tool_choice names the function '{name}', which tools do not hold", "tool_choice")
    return ToolCalls("named", [name], functions[name])


def tool_parameters(params: dict, index: int) -> dict:
    """A tool's parameters, checked on their own: a 400 naming the tool and the keyword the output
    cannot be held to or that nothing meets (the schema the output is held to is rewritten whole,
    later, with the other tools')."""
    from ..constrain import check_schema
    from ..schema_keywords import enforceable

    field = f"tools.{index}.function.parameters"
    try:
        check_schema(params)  # its bounds first: the walk's work is in proportion to them
        enforceable(params)
    except SpeculantError as e:
        raise ApiError(400, f"{field}: {e}", "tools") from None
    return params


SCHEMA_DATA = ("enum", "const", "default", "examples", "example")  # values, not schemas: their "$ref"s are text


def rebased(params: dict, base: str) -> dict:
    """A copy of ``params`` with its local ``$ref``s ("#/...", relative to its root) pointing into
    ``base``, where it sits in a larger schema (a walk, not recursion; check_schema bounded its depth)."""
    out = json.loads(json.dumps(params))
    todo = [out]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                    node[key] = base + value[1:]
                elif key not in SCHEMA_DATA:
                    todo.append(value)
    return out


def tool_messages(generator, body: ChatRequest, messages: list[dict], plan: ToolCalls) -> tuple[list[dict], list]:
    """The messages and the template's ``tools`` for a request told to call its tools: the template
    renders them where it knows how (it reads ``tools``), else a system message lists them."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    template = generator.tokenizer.chat_template
    if isinstance(template, str) and "tools" in template:
        return messages, tools
    listing = json.dumps([t["function"] for t in tools])
    if plan.mode == "named":
        ask = f"Call the function {plan.names[0]}: answer with its arguments as one JSON object."
    else:
        ask = 'Call one of them: answer with one JSON object {"name": ..., "arguments": {...}}.'
    return [{"role": "system", "content": f"You can call these functions: {listing}. {ask}"}] + messages, []


def text_content(content, field: str) -> str:
    if content is None or isinstance(content, str):
        return checked_text(content or "", field)
    parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    if len(parts) != len(content):
        raise ApiError(400, "only text message parts are supported", field)
    if not all(isinstance(p, str) for p in parts):
        raise ApiError(400, f"{field}: a text part's 'text' must be a string", field)
    return checked_text("".join(parts), field)


def chat_prompt(generator, messages: list[dict], tools: list | None = None) -> list[int]:
    """The chat template's token ids for these messages (and ``tools``, for a template that renders
    them) and the assistant's turn to come."""
    try:
        ids = generator.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      **({"tools": tools} if tools else {}))
    except Exception as e:  # a template that rejects these roles or this order says so in its own words
        from jinja2 import TemplateError  # transformers' dependency: here only where a template failed

        said = str(e)
        if isinstance(e, TemplateError) and said and "\n" not in said and len(said) < 300:
            raise ApiError(400, f"the chat template rejected these messages: {said}", "messages") from None
        log.exception("the chat template failed")
        raise ApiError(400, "the chat template could not render these messages: check their roles and order",
                       "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def sampling_settings(generator, body: Sampling, logprobs: int | None) -> dict:
    """The request's sampling settings, checked against the model (so one request's bad bias or
    top_k never fails the batch it would share), with its γ setting and logprobs."""
    settings = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                    repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias or None)
    try:
        LogitsProcessing(SamplingParams(**settings), generator.target.vocab_size)
    except SpeculantError as e:
        param = "top_k" if "top-k" in str(e) else "logit_bias" if body.logit_bias else None
        raise ApiError(400, str(e), param) from None
    try:
        gamma = generator.check_gamma(body.gamma) if body.gamma is not None else None
    except SpeculantError as e:  # beyond what this drafter's proposals hold
        raise ApiError(400, str(e), "gamma") from None
    return settings | {"logprobs": logprobs, "gamma": gamma, "speculate": body.speculate}


def format_processor(generator, fmt: dict, prompts: list[list[int]] | None = None,
                     timeout: float | None = SCHEMA_SECONDS, field: str = "response_format"):
    """``response_format``'s logits processor (lm-format-enforcer, an optional dependency), checked
    against the schema bounds and prepared with each prompt's first state in a worker stopped
    after ``timeout`` seconds: the engine then never waits on building it."""
    from ..constrain import json_schema_processor

    kind = fmt.get("type")
    if kind == "json_object":
        schema = None
    elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        schema = fmt["json_schema"].get("schema", {})
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON Schema object", "response_format")
    else:
        raise ApiError(400, "response_format must be {'type': 'text' | 'json_object'} or {'type': 'json_schema', "
                            "'json_schema': {'schema': {...}}}", "response_format")
    try:
        proc = json_schema_processor(generator.tokenizer, schema, generator.target.eos_token_ids, prompts, timeout)
    except SpeculantError as e:
        raise ApiError(400, f"{field}: {e}", field) from None
    proc.end_quietly = True  # past its budget of parser work its rows end and the scheduler says why
    return proc


def token_budget(generator, prompts: list[list[int]], max_tokens: int | None) -> int:
    """max_tokens, checked against the context (a chat request without one: up to 1,024 tokens, or
    what the context leaves; the KV cache is sized by it)."""
    context, longest = generator.target.context_length, max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, context - longest))
    if longest + max_tokens > context:
        raise ApiError(400, f"the prompt ({longest} tokens) plus max_tokens ({max_tokens}) is more than the "
                            f"model's context of {context} tokens: shorten the prompt or lower max_tokens",
                       "max_tokens")
    return max_tokens


# what a choice holds beside its caches and logits, per token (its text and ids in the engine's row,
# the stream's pieces and events, prompt lookup's tables: ~800 B a token measured), per logprob
# alternative per token, and per state of a JSON schema's tables (measured: ~5 KB a state with a
# 49k vocabulary, the tables shared between states)
BUFFER_BYTES_PER_TOKEN = 2048
LOGPROB_BYTES = 160
SCHEMA_STATE_BYTES = 8192


def extra_bytes(generator, prompts: list[list[int]], max_tokens: int, logprobs: int | None, gamma,
                constrained: bool) -> int:
    """Bytes one choice holds beside its caches and a pass's logits, at most: its buffers, its
    logprobs, and a schema's tables (a state per prefix scored: up to a pass's width per token)."""
    width = 1 + (gamma if isinstance(gamma, int) else generator.engine.most_auto_drafts)
    extra = (max(map(len, prompts)) + max_tokens) * BUFFER_BYTES_PER_TOKEN
    if logprobs is not None:
        extra += max_tokens * (logprobs + 1) * LOGPROB_BYTES
    if constrained:
        extra += max_tokens * width * SCHEMA_STATE_BYTES
    return extra


def check_request(generator, body: Sampling, prompts: list[list[int]], max_tokens: int, settings: dict,
                  logprobs: int | None = None, constrained: bool = False,
                  server_budget: int | None = None) -> tuple[list[str], int, int]:
    """The request's stop strings, the bytes it needs in all (caches of every choice, logits,
    buffers) and each choice's buffers; refuses one that could never fit: past the memory one
    request may use (``Generator.memory_budget``) or the server's in all (``server_budget``)."""
    try:
        stop = check_stop(body.stop)
    except SpeculantError as e:
        raise ApiError(400, str(e), "stop") from None
    gamma = settings["gamma"] if settings["gamma"] is not None else generator.gamma
    gamma = gamma if body.speculate and generator.drafter.name != "none" else 0
    rows, longest = len(prompts) * body.n, max(map(len, prompts))
    extra = extra_bytes(generator, prompts, max_tokens, logprobs, gamma, constrained)
    try:
        generator.check_memory(rows, longest, max_tokens, gamma, extra)
    except SpeculantError as e:
        raise ApiError(400, str(e), "max_tokens") from None
    need = generator.memory_needed(rows, longest, max_tokens, gamma, extra)
    if server_budget is not None and need > server_budget:
        raise ApiError(400, f"this request needs about {gib(need)} ({rows} rows of up to "
                            f"{min(longest + max_tokens, generator.target.context_length)} tokens), more than the "
                            f"{gib(server_budget)} this server has for all its requests (--max-memory): ask for "
                            "fewer new tokens, fewer choices or a shorter prompt", "max_tokens")
    return stop, need, extra


def make_jobs(body: Sampling, prompts: list[list[int]], max_tokens: int, stop: list[str], settings: dict,
              sink_for, extra: int = 0) -> list[Job]:
    """One job per choice (``n`` per prompt), each with its events going to ``sink_for(index)``.
    Requests share batches by γ setting and the forms of text their processing reads; the rest of
    the settings are per row (a seeded choice's text is the same whatever it shares a batch with)."""
    forms = SamplingParams(**{k: v for k, v in settings.items() if k not in ("logprobs", *BATCH_SETTINGS)}).forms
    group = json.dumps({"forms": forms, **{k: settings[k] for k in BATCH_SETTINGS}}, sort_keys=True)
    choices = [p for p in prompts for _ in range(body.n)]
    return [Job(p, max_tokens, sink_for(i), stop, settings, None if body.seed is None else row_seed(body.seed, i),
                group, extra=extra) for i, p in enumerate(choices)]

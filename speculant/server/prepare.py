"""How a request becomes the engine's work: prompts (tokenised, or through the chat template),
sampling settings checked against the model, a JSON-schema processor, and the checks that need
the model (context, memory, the drafter's largest γ). Plain functions of the request and the
Generator: each testable without HTTP. Raise ``ApiError`` with the field at fault."""
from __future__ import annotations

import json
import logging

from ..errors import SpeculantError
from ..limits import check_stop, check_text
from ..sampling import LogitsProcessing, SamplingParams, row_seed
from .requests import ChatRequest, Sampling
from .responses import ApiError
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
    """The chat messages as the template takes them: text only."""
    return [{"role": m.role, "content": text_content(m.content, f"messages.{i}.content")}
            for i, m in enumerate(body.messages)]


def text_content(content, field: str) -> str:
    if content is None or isinstance(content, str):
        return checked_text(content or "", field)
    parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    if len(parts) != len(content):
        raise ApiError(400, "only text message parts are supported", field)
    if not all(isinstance(p, str) for p in parts):
        raise ApiError(400, f"{field}: a text part's 'text' must be a string", field)
    return checked_text("".join(parts), field)


def chat_prompt(generator, messages: list[dict]) -> list[int]:
    """The chat template's token ids for these messages and the assistant's turn to come."""
    try:
        ids = generator.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
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


def format_processor(generator, fmt: dict):
    """``response_format``'s logits processor (lm-format-enforcer, an optional dependency)."""
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
        return json_schema_processor(generator.tokenizer, schema, generator.target.eos_token_ids)
    except SpeculantError as e:
        raise ApiError(400, f"response_format: {e}", "response_format") from None


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


def check_request(generator, body: Sampling, prompts: list[list[int]], max_tokens: int, settings: dict) -> list[str]:
    """The request's stop strings; refuses one whose caches would pass the memory budget."""
    try:
        stop = check_stop(body.stop)
    except SpeculantError as e:
        raise ApiError(400, str(e), "stop") from None
    gamma = settings["gamma"] if settings["gamma"] is not None else generator.gamma
    try:
        generator.check_memory(len(prompts) * body.n, max(map(len, prompts)), max_tokens,
                               gamma if body.speculate else 0)
    except SpeculantError as e:
        raise ApiError(400, str(e), "max_tokens") from None
    return stop


def make_jobs(body: Sampling, prompts: list[list[int]], max_tokens: int, stop: list[str], settings: dict,
              sink_for) -> list[Job]:
    """One job per choice (``n`` per prompt), each with its events going to ``sink_for(index)``.
    Requests share batches by γ setting and the forms of text their processing reads; the rest of
    the settings are per row (a seeded choice's text is the same whatever it shares a batch with)."""
    forms = SamplingParams(**{k: v for k, v in settings.items() if k not in ("logprobs", *BATCH_SETTINGS)}).forms
    group = json.dumps({"forms": forms, **{k: settings[k] for k in BATCH_SETTINGS}}, sort_keys=True)
    choices = [p for p in prompts for _ in range(body.n)]
    return [Job(p, max_tokens, sink_for(i), stop, settings, None if body.seed is None else row_seed(body.seed, i),
                group) for i, p in enumerate(choices)]

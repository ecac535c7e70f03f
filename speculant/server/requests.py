"""The server's request bodies (pydantic models) and how a body that fails them is told so: one
line naming the field and what it takes, never pydantic's internals (union tags such as
``prompt.list[int]``) or a library's message.

Every number is bounded here (``speculant.limits``: γ, logprobs, stop strings, logit bias);
what depends on the model (vocabulary, context, memory, a drafter's largest γ) is checked when the
request is served.
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr

from ..limits import MAX_GAMMA, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOPS

MAX_CHOICES = 16  # n
MAX_TOOLS = 64  # tools per request (and tool calls per message)
Number = Annotated[float, Strict()]  # a JSON number (an integer too), never "0.5" or true


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class Sampling(BaseModel):
    """Fields both endpoints share (OpenAI's defaults: temperature 1, top_p 1)."""

    # strict ints, floats and bools: JSON's true is not 1 token nor a temperature, nor 16.0 or "16"
    # a count, nor "0.5" a number (pydantic's lax mode takes them); no NaN or Infinity (Python's
    # JSON parser reads them)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0, le=2)
    top_p: Number = Field(1.0, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)] | Annotated[
        list[Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)] | None = None
    seed: StrictInt | None = None  # any integer: mixed into 63 bits
    presence_penalty: Number = Field(0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(0.0, ge=-2, le=2)
    logit_bias: Annotated[dict[int, Annotated[Number, Field(ge=-100, le=100)]],  # OpenAI's range
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: StrictStr | None = None
    # speculant's own
    gamma: Annotated[StrictInt, Field(ge=1, le=MAX_GAMMA)] | Literal["auto"] | None = None
    speculate: StrictBool = True  # false: plain decoding (the playground's comparison button)
    top_k: StrictInt = Field(0, ge=0)
    min_p: Number = Field(0.0, ge=0, le=1)  # 1: only the most likely tokens (greedy, ties shared)
    repetition_penalty: Number = Field(1.0, gt=0, le=100)
    response_format: dict | None = None  # both endpoints: json_object or json_schema


class CompletionRequest(Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None
    tool_calls: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's calls, as sent back
    tool_call_id: StrictStr | None = None  # a tool's answer: the call it answers


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    # OpenAI's rule for a function's name: letters, digits, underscores and dashes, at most 64
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON Schema object (none: no arguments)
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr


class ChosenTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: ChosenFunction


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChosenTool | None = None
    parallel_tool_calls: StrictBool | None = None


# what a field takes, for the fields whose type is a union (pydantic reports one error per member)
EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": f"a string or a list of at most {MAX_STOPS} strings, each at most {MAX_STOP_CHARS} characters",
    "gamma": f"'auto' or an integer in 1..{MAX_GAMMA}",
    "content": "a string, or a list of {'type': 'text', 'text': ...} parts",
    "logit_bias": f"an object of at most {MAX_LOGIT_BIAS} token ids -> numbers in -100..100",
    "seed": "an integer",
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
}
# the names pydantic gives a union's members in an error's location: str, list[int], literal['auto'],
# a model's class name, ...
_UNION_TAG = re.compile(r"^(str|int|float|bool|none)$|\[|^(constrained|function|json-or)-|^(ChosenTool|StreamOptions)$")
# what a value of each kind must be, by pydantic's error type
_MUST = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false", "string_type": "a string",
    "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
    "mapping_type": "an object", "list_type": "an array", "tuple_type": "an array", "set_type": "an array",
    "none_required": "null",
}


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _shown(value) -> str:
    said = repr(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else json_kind(value)
    return said if len(said) <= 60 else said[:57] + "..."


def validation_message(errors: list[dict], model: type[BaseModel] | None = None) -> tuple[str, str | None]:
    """(message, param) for a body pydantic refused: its first error, said in the request's terms
    (never pydantic's own words: "Input should be ...")."""
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    ctx = first.get("ctx") or {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if kind == "json_invalid":  # loc is the character offset where parsing failed
        at = first.get("loc", ("body", "?"))[-1]
        return f"the request body is not valid JSON (at character {at}): send a JSON object", None
    if not loc:
        if kind == "missing":
            return "the request has no body: send a JSON object", None
        return "the request body must be a JSON object (Content-Type: application/json)", None
    # drop the union member tags pydantic adds to a location: prompt.list[int].0 -> prompt.0
    path = [x for x in loc if not _UNION_TAG.search(x)]
    where = ".".join(path)
    field = next((x for x in reversed(path) if x in EXPECTED), None)
    value = first.get("input")
    if kind == "missing":
        return f"{where} is required", where
    if field is not None:
        return f"{where}: expected {EXPECTED[field]}", where
    bounds = _bounds(model, path[0]) if model is not None and len(path) == 1 else None
    if bounds and ("than" in kind or kind == "finite_number"):
        return f"{where} must be {bounds}, got {_shown(value)}"[:300], where
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):  # an integer past 1e308
        return f"{where} must be {bounds or 'a finite number'}, got {_shown(value)}", where
    if kind in _MUST:
        return f"{where} must be {_MUST[kind]}, got {_shown(value)}", where
    if kind == "literal_error":
        return f"{where} must be one of {ctx.get('expected', 'the allowed values')}, got {_shown(value)}"[:300], where
    if kind == "too_short":
        least = ctx.get("min_length", 1)
        return f"{where} must hold at least {least} item{'s' if least != 1 else ''}, got none", where
    if kind in ("too_long", "string_too_long"):
        unit = "characters" if kind == "string_too_long" else "items"
        return f"{where} must hold at most {ctx.get('max_length')} {unit}", where
    if kind == "string_too_short":
        return f"{where} must not be empty", where
    if kind == "string_pattern_mismatch":
        return f"{where} must match {ctx.get('pattern')} (letters, digits, '_' and '-')", where
    words = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in words:
        limit = next(iter(ctx.values()), "?")
        return f"{where} must be {words[kind]} {limit}, got {_shown(value)}", where
    if kind == "extra_forbidden":
        return f"{where} is not a field this request takes", where
    return f"{where} is not valid here: see the API's fields", where


def _bounds(model: type[BaseModel], name: str) -> str | None:
    """A numeric field's range in words ("in 1..16", "> 0 and <= 100"), from its declaration."""
    info = model.model_fields.get(name)
    if info is None:
        return None
    names = {"Ge": "ge", "Gt": "gt", "Le": "le", "Lt": "lt"}
    parts = {type(m).__name__: getattr(m, names[type(m).__name__]) for m in info.metadata
             if type(m).__name__ in names}
    if "Ge" in parts and "Le" in parts:
        return f"in {parts['Ge']}..{parts['Le']}"
    words = {"Ge": ">=", "Gt": ">", "Le": "<=", "Lt": "<"}
    return " and ".join(f"{words[k]} {v}" for k, v in parts.items()) or None

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

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..limits import MAX_GAMMA, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOPS

MAX_CHOICES = 16  # n


class Sampling(BaseModel):
    """Fields both endpoints share (OpenAI's defaults: temperature 1, top_p 1)."""

    # strict ints and bools: JSON's true is not 1 token, nor 16.0 or "16" a count (pydantic's lax
    # mode takes them); no NaN or Infinity (Python's JSON parser reads them)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: dict | None = None
    stop: Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)] | Annotated[
        list[Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)] | None = None
    seed: StrictInt | None = None  # any integer: mixed into 63 bits
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Annotated[dict[int, Annotated[float, Field(ge=-100, le=100)]],  # OpenAI's range
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: StrictStr | None = None
    # speculant's own
    gamma: Annotated[StrictInt, Field(ge=1, le=MAX_GAMMA)] | Literal["auto"] | None = None
    speculate: StrictBool = True  # false: plain decoding (the playground's comparison button)
    top_k: StrictInt = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, lt=1)
    repetition_penalty: float = Field(1.0, gt=0, le=100)
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


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)


# what a field takes, for the fields whose type is a union (pydantic reports one error per member)
EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": f"a string or a list of at most {MAX_STOPS} strings, each at most {MAX_STOP_CHARS} characters",
    "gamma": f"'auto' or an integer in 1..{MAX_GAMMA}",
    "content": "a string, or a list of {'type': 'text', 'text': ...} parts",
    "logit_bias": f"an object of at most {MAX_LOGIT_BIAS} token ids -> numbers in -100..100",
    "seed": "an integer",
}
# the names pydantic gives a union's members in an error's location: str, list[int], literal['auto'], ...
_UNION_TAG = re.compile(r"^(str|int|float|bool|none)$|\[|^(constrained|function|json-or)-")


def validation_message(errors: list[dict], model: type[BaseModel] | None = None) -> tuple[str, str | None]:
    """(message, param) for a body pydantic refused: its first error, said in the request's terms."""
    first = errors[0] if errors else {}
    kind = first.get("type", "")
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
    if kind == "missing":
        return f"{where} is required", where
    if field is not None:
        return f"{where}: expected {EXPECTED[field]}", where
    bounds = _bounds(model, path[0]) if model is not None and len(path) == 1 else None
    if bounds and ("than" in kind or kind == "finite_number"):
        return f"{where} must be {bounds}, got {first.get('input')!r}"[:300], where
    msg = "must be a finite number" if kind == "finite_number" else first.get("msg", "is not valid")
    return f"{where}: {msg}", where


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

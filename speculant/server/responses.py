"""What the server sends back, in OpenAI's shapes: error bodies, choices, streamed chunks, usage,
logprobs, and speculant's own stats beside them (OpenAI clients ignore the extra fields)."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "abort": "abort"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}


class ApiError(Exception):
    """A request the server refuses: its status, a one-line message, the field it names, and for a
    429 the seconds to wait before retrying (``Retry-After``)."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after


@dataclass
class ToolCalls:
    """How a chat request's tools are called: ``required`` (one of ``names``: the output is
    {"name", "arguments"}) or ``named`` (that one function: the output is its arguments), the
    output held to ``schema``."""

    mode: str
    names: list[str]
    schema: dict

    def call(self, text: str) -> dict | None:
        """The tool call an output makes, as OpenAI gives it; None where it makes none (cut short)."""
        if self.mode == "named":
            name, arguments = self.names[0], text.strip()
        else:
            try:
                obj = json.loads(text)
            except ValueError:
                return None
            if not isinstance(obj, dict) or obj.get("name") not in self.names:
                return None
            name, arguments = obj["name"], json.dumps(obj.get("arguments", {}))
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def finish(self, out) -> str | None:
        """OpenAI's finish reason: "tool_calls" for a call the model chose to make, "stop" for one
        tool_choice named; "length" where the output was cut short."""
        finish = FINISH.get(out.finish_reason)
        if finish != "stop":
            return finish
        return "stop" if self.mode == "named" else "tool_calls"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": encodable(message), "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": encodable(param), "code": None}}


def encodable(text: str | None) -> str | None:
    """``text`` with what UTF-8 cannot carry (a lone surrogate a request sent, echoed back in its
    error) written as an escape: the body is then always sendable, the error never a bare 500."""
    if text is None:
        return None
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def sse(obj: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"


def usage(outputs, n: int) -> dict:
    """OpenAI's usage: each prompt's tokens once (not once for each of its ``n`` choices, which
    follow one another), every choice's completion."""
    prompt = sum(next((len(o.prompt_token_ids) for o in outputs[i : i + n] if o is not None), 0)
                 for i in range(0, len(outputs), n))
    completion = sum(len(o.token_ids) for o in outputs if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def stats(outputs) -> dict:
    """α and τ over the choices of one response."""
    drafted = sum(o.stats["draft_tokens"] for o in outputs)
    accepted = sum(o.stats["accepted_draft_tokens"] for o in outputs)
    passes = sum(o.stats["target_forward_passes"] for o in outputs)
    tokens = sum(o.stats["new_tokens"] for o in outputs)
    return {"acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_accepted_tokens": round(tokens / passes, 4) if passes else 0.0,
            "target_forward_passes": passes, "drafter": outputs[0].stats["drafter"]}


def logprobs_body(entries, chat: bool, tok) -> dict | None:
    """A choice's logprobs in the chat or the completions shape."""
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


@dataclass
class Reply:
    """The parts every piece of one response shares: its id, time, model name, endpoint kind, and
    whether (and how many) logprobs were asked for."""

    id: str
    created: int
    model: str
    chat: bool
    tok: object  # the tokenizer: logprobs name their tokens
    logprobs: int | None = None  # None: not asked for
    tools: ToolCalls | None = None  # a chat request told to call its tools

    def message(self, out) -> tuple[dict, str | None]:
        """A chat choice's message and finish reason: its text, or the tool call it makes."""
        call = self.tools.call(out.text) if self.tools is not None else None
        if call is None:
            return {"role": "assistant", "content": out.text}, FINISH.get(out.finish_reason)
        return {"role": "assistant", "content": None, "tool_calls": [call]}, self.tools.finish(out)

    def choice(self, index: int, out) -> dict:
        lp = logprobs_body(out.logprobs, self.chat, self.tok) if self.logprobs is not None else None
        if self.chat:
            message, finish = self.message(out)
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
        return {"index": index, "text": out.text, "logprobs": lp, "finish_reason": FINISH.get(out.finish_reason)}

    def tool_chunk(self, index: int, out) -> dict:
        """A streamed choice of a tool-calling request, whole at its end: the call (or, where the
        output makes none, its text) in one delta, with the finish reason and stats."""
        message, finish = self.message(out)
        delta = message if "tool_calls" not in message else \
            {**message, "tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
        lp = logprobs_body(out.logprobs, self.chat, self.tok) if self.logprobs is not None else None
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                  "speculant": {"tokens": [], "stats": stats([out])}}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [choice]}

    def whole(self, outputs, n: int) -> dict:
        """A non-streamed response."""
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [self.choice(i, o) for i, o in enumerate(outputs)], "usage": usage(outputs, n),
                "speculant": stats(outputs)}

    def chunk(self, index, text: str, finish, tokens: list[dict], out=None) -> dict:
        """One streamed event: new text with each token's origin; the last one of a choice (``out``:
        its Output) carries the finish reason, its stats and, when asked, its logprobs."""
        entries = out.logprobs if out is not None else None
        lp = logprobs_body(entries, self.chat, self.tok) if self.logprobs is not None and entries is not None else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if text or finish is None else {}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        choice["speculant"] = {"tokens": tokens} | ({"stats": stats([out])} if out is not None else {})
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, outputs, n: int) -> dict:
        """The last event when ``stream_options.include_usage`` asks for it."""
        return self.chunk(None, "", None, []) | {"choices": [], "usage": usage(outputs, n)}

"""What one request may ask for: the bounds the Python API, the CLI and the server all check where
they parse a request, each refused with a one-line error naming the setting and its range.

They keep one request from taking a machine down: a γ of a million drafts ~8,000 tokens a pass
(gigabytes of logits), a million logprobs lists the whole vocabulary per token, a long stop string
costs its length squared per streamed token. The memory a request's caches need is checked
against a budget before it starts (``Generator.memory_needed``, ``Generator.memory_budget``).
"""
from __future__ import annotations

from .errors import SpeculantError

MAX_GAMMA = 64  # draft tokens per pass, a fixed γ ("auto" drafts at most 16, or 48 tree nodes on a GPU)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's bound)
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 500  # characters per stop string
MAX_LOGIT_BIAS = 1024  # biased tokens per request
# a JSON schema (response_format, --json-schema): each state of the output costs time in proportion
# to its alternatives (measured: ~2.5 ms per anyOf member per state with a 49k vocabulary), and it
# is prepared (its parser, the prompt's first state) in a worker stopped after SCHEMA_SECONDS
MAX_SCHEMA_BYTES = 64 * 1024  # as JSON
MAX_SCHEMA_DEPTH = 64  # nesting of the schema document
MAX_SCHEMA_ALTERNATIVES = 128  # anyOf / oneOf / allOf members, summed
SCHEMA_SECONDS = 5.0
# the parser's work while the output is written (the server's: in the request's own process, at a
# lower priority than the engine; the Python API's: on its thread): at most this long for one state
# (an ordinary schema's take 1 ms to 0.5 s with a 49k vocabulary: each state inside a string with a
# maxLength walks the whole vocabulary), and for all of a request's states this long plus
# SCHEMA_STATE_SHARE a state; over either the request ends with an error and the batch goes on
SCHEMA_STATE_SECONDS = 2.0
SCHEMA_REQUEST_SECONDS = 10.0
SCHEMA_STATE_SHARE = 0.2
MEMORY_SHARE = 0.5  # of the memory free when a generator is built: the default budget of one request
SERVER_MEMORY_SHARE = 0.8  # of the memory free when a server starts: its default budget for all its requests


def check_int(value, name: str, lo: int, hi: int | None = None, what: str = "") -> int:
    """``value`` as an int in lo..hi (no bools, no floats), else a SpeculantError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        span = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise SpeculantError(f"{name}{f' ({what})' if what else ''} must be an integer {span}, got {value!r}")
    return value


def check_stop(stop) -> list[str]:
    """Stop strings as a list: a string is one stop string, never its characters."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise SpeculantError(f"stop must be a string or a list of strings, got {_kind(stop)}")
    if len(stop) > MAX_STOPS:
        raise SpeculantError(f"stop holds {len(stop)} strings: at most {MAX_STOPS} are allowed")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise SpeculantError(f"a stop string has {max(map(len, stop))} characters: at most {MAX_STOP_CHARS} are allowed")
    for s in stop:
        check_text(s, "stop")
    return list(stop)


def check_text(text: str, name: str) -> str:
    """Text a tokenizer can take: UTF-8 encodable (JSON's "\\ud800" decodes to a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpeculantError(f"{name} holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is "
                             "not text: send valid UTF-8") from None
    return text


def _kind(x) -> str:
    return "None" if x is None else type(x).__name__


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.0f} MiB"

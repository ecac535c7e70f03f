"""Constrained output through the logits-processor hook (``SamplingParams.logits_processors``).

A processor is ``fn(token_ids, logits) -> logits`` where ``token_ids`` is the full context (prompt,
output so far, and -- while drafting or verifying -- the draft tokens before this position). The
engine applies the same processors to the target's p and the drafter's q, each on its own context,
so masking stays lossless and drafts that obey the constraint keep being accepted.

JSON schema constraints use lm-format-enforcer (``pip install lm-format-enforcer``): its states
are keyed by the token prefix (here by a digest of it), so it answers for any draft prefix, not
only for the one sequence plain decoding would walk. A schema is bounded (``speculant.limits``:
size, nesting, alternatives) and prepared within a time limit: the server computes each prompt's
first state, the costly part, in a child process killed at the limit, so the engine never waits
on it.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import multiprocessing
import os
import threading
import warnings
from array import array
from typing import Callable

import torch

from .errors import SpeculantError
from .limits import MAX_SCHEMA_ALTERNATIVES, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, SCHEMA_SECONDS


def allowed_tokens_processor(allowed: Callable[[list[int]], list[int]]):
    """A processor that keeps only ``allowed(token_ids)`` (sets every other logit to -inf)."""

    def process(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = torch.tensor(allowed(token_ids), dtype=torch.long, device=logits.device)
        keep = keep[keep < logits.shape[-1]]
        masked = torch.full_like(logits, float("-inf"))
        masked[keep] = logits[keep]
        return masked

    return process


_TOKENIZER_DATA: dict = {}  # (id(tokenizer), eos) -> (tokenizer, data): building it decodes the whole vocabulary


def _tokenizer_data(tokenizer, eos_token_ids):
    """lm-format-enforcer's view of a tokenizer (its own transformers integration imports a module
    transformers 5 removed, so this is that function, rebuilt on the public tokenizer API)."""
    key = (id(tokenizer), tuple(sorted(eos_token_ids or ())))
    if key not in _TOKENIZER_DATA:
        _TOKENIZER_DATA[key] = (tokenizer, _build_tokenizer_data(tokenizer, eos_token_ids))
    return _TOKENIZER_DATA[key][1]


def _build_tokenizer_data(tokenizer, eos_token_ids):
    from lmformatenforcer import TokenEnforcerTokenizerData  # the structured extra, installed apart

    special = set(tokenizer.all_special_ids)
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    regular = []
    for tok in range(len(tokenizer)):
        if tok in special:
            continue
        # decode after "0" and drop it: keeps a word-start token's leading space
        after_zero = tokenizer.decode([zero, tok])[1:]
        regular.append((tok, after_zero, len(after_zero) > len(tokenizer.decode([tok]))))
    eos = sorted(eos_token_ids) if eos_token_ids else tokenizer.eos_token_id
    return TokenEnforcerTokenizerData(regular, lambda ids: tokenizer.decode(ids).rstrip("\ufffd"), eos, False, len(tokenizer))


def schema_shape(schema) -> tuple[int, int]:
    """(nesting depth, anyOf/oneOf/allOf alternatives summed) of a JSON value,
    walked without recursion (a schema nested 100,000 deep costs a loop, not Python's stack)."""
    depth, alternatives, todo = 0, 0, [(schema, 1)]
    while todo:
        node, level = todo.pop()
        depth = max(depth, level)
        if depth > MAX_SCHEMA_DEPTH:
            return depth, alternatives
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("anyOf", "oneOf", "allOf") and isinstance(value, list):
                    alternatives += len(value)
                todo.append((value, level + 1))
        elif isinstance(node, list):
            todo.extend((value, level + 1) for value in node)
    return depth, alternatives


def check_schema(schema, what: str = "the JSON schema") -> None:
    """Refuse a schema past the bounds of ``speculant.limits`` (its size, nesting, alternatives):
    each state of the output costs time in proportion to them, and a table is built per state."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise SpeculantError(f"unusable JSON schema: it must be a JSON object, got {type(schema).__name__}")
    depth, alternatives = schema_shape(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise SpeculantError(f"{what} is nested more than {MAX_SCHEMA_DEPTH} levels deep: at most "
                             f"{MAX_SCHEMA_DEPTH} are allowed")
    if alternatives > MAX_SCHEMA_ALTERNATIVES:
        raise SpeculantError(f"{what} has {alternatives:,} alternatives (anyOf, oneOf and allOf members): "
                             f"at most {MAX_SCHEMA_ALTERNATIVES} are allowed (each one costs time at every token)")
    try:
        size = len(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError):
        raise SpeculantError(f"unusable JSON schema: {what} must hold JSON values only (no NaN or Infinity)") from None
    if size > MAX_SCHEMA_BYTES:
        raise SpeculantError(f"{what} is {size:,} bytes as JSON: at most {MAX_SCHEMA_BYTES:,} are allowed")


class _Late(BaseException):
    """Raised inside a preparation that ran past its time (a BaseException: libraries' ``except
    Exception`` blocks do not swallow it)."""


def within(seconds: float, fn: Callable, what: str):
    """``fn()`` run in a worker thread and stopped once it has run ``seconds`` (an exception raised in
    it at its next Python step): a SpeculantError saying so, and the worker ends. Its own errors are
    raised here."""
    done: dict = {}

    def work():
        try:
            done["value"] = fn()
        except _Late:
            done["late"] = True
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            done["error"] = e

    worker = threading.Thread(target=work, name="speculant-prepare", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(_Late))
        worker.join(5.0)
        raise SpeculantError(f"{what} takes longer than {seconds:g} s to prepare: send a simpler one "
                             "(fewer alternatives, a smaller schema)")
    if "error" in done:
        raise done["error"]
    return done["value"]


_PREPARING = threading.Lock()  # one preparation at a time: two would halve each one's time, and the engine's


class SchemaProcessor:
    """A JSON-schema processor over lm-format-enforcer's parser, its states kept by a 128-bit digest
    of their token prefix (the library keys them by the whole prefix as a tuple: a copy of the text
    per state, quadratic in the output's length). ``prepare(prompt)`` builds a prompt's first state
    ahead (the server does, in a worker, before the engine sees the request)."""

    def __init__(self, enforcer):
        self.enforcer = enforcer
        self.states: dict[tuple[int, bytes], object] = {}
        self.tables: dict[tuple[int, int], object] = {}  # distinct allowed-token tables

    @staticmethod
    def _key(ids) -> tuple[int, bytes]:
        return len(ids), hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()

    def allowed(self, token_ids: list[int]) -> list[int]:
        """The token ids allowed after ``token_ids`` (the prompt, the output so far, drafts)."""
        enf = self.enforcer
        key = self._key(token_ids)
        state = self.states.get(key)
        if state is not None:
            return state.allowed_tokens.allowed_tokens
        parent = self.states.get(self._key(token_ids[:-1])) if token_ids else None
        if parent is None:  # the prompt: the parser's first state
            state = type(enf).OutputTensorState(parser=enf.root_parser)
        else:
            state = enf._apply_new_characters(parent, token_ids)
        enf._compute_allowed_tokens(tuple(token_ids[-1:]), state)
        # one copy of each distinct table: inside a JSON string every state allows the same ~all of
        # the vocabulary, a list of its own per state (440 KB each with a 49k vocabulary) otherwise
        table = state.allowed_tokens.allowed_tokens
        if isinstance(table, list):
            seen = self.tables.setdefault((len(table), hash(tuple(table))), state.allowed_tokens)
            if seen is not state.allowed_tokens and seen.allowed_tokens == table:
                state.allowed_tokens = seen
        self.states[key] = state
        return state.allowed_tokens.allowed_tokens

    def prepare(self, prompt: list[int]) -> None:
        self.allowed(list(prompt))

    def seed(self, prompt: list[int], table: list[int]) -> None:
        """A prompt's first state with its table computed elsewhere (``prepare`` in a child process)."""
        from lmformatenforcer.tokenlist import TokenList

        enf = self.enforcer
        tokens = TokenList(False, enf.vocab_size)
        tokens.allowed_tokens = table
        self.states[self._key(prompt)] = type(enf).OutputTensorState(parser=enf.root_parser, allowed_tokens=tokens)

    @property
    def size(self) -> int:
        return len(self.states)

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = torch.tensor(self.allowed(token_ids), dtype=torch.long, device=logits.device)
        keep = keep[keep < logits.shape[-1]]
        masked = torch.full_like(logits, float("-inf"))
        masked[keep] = logits[keep]
        return masked


def _build(data, schema: dict | None, prompts) -> SchemaProcessor:
    """The processor of ``schema`` with each prompt's first state computed; a SpeculantError naming
    what is wrong with a schema the library refuses."""
    from lmformatenforcer import JsonSchemaParser, TokenEnforcer

    try:
        proc = SchemaProcessor(TokenEnforcer(data, JsonSchemaParser(schema)))
        for p in prompts or ():
            proc.prepare(p)
    except _Late:
        raise
    except RecursionError:
        raise SpeculantError(f"unusable JSON schema: nested too deeply to read (at most {MAX_SCHEMA_DEPTH} "
                             "levels)") from None
    except Exception as e:
        # its own words where it refuses a schema on purpose ("Unsupported type objectx": a plain
        # Exception or ValueError, one line); anything else is its internals, not the user's business
        said = str(e)
        why = f": {said}" if type(e) in (Exception, ValueError) and said and "\n" not in said and len(said) < 200 else ""
        raise SpeculantError(f"unusable JSON schema{why}: give a JSON Schema object of the types object, array, "
                             "string, number, integer, boolean or null") from None
    return proc


def _first_tables(data, schema, prompts, conn) -> None:
    """In a child process: the prompts' first tables, sent back (or why the schema is refused). It
    runs at a lower priority than the engine: on a busy machine a pass waits for no schema."""
    try:
        os.nice(10)
    except (AttributeError, OSError):
        pass
    try:
        proc = _build(data, schema, prompts)
        conn.send(("ok", [list(proc.allowed(list(p))) for p in prompts]))
    except SpeculantError as e:
        conn.send(("refused", str(e)))
    except BaseException:  # noqa: BLE001 -- the parent says it in one line
        conn.send(("refused", "unusable JSON schema: it could not be prepared"))
    finally:
        conn.close()


def _in_child(data, schema, prompts, seconds: float) -> list[list[int]]:
    """The prompts' first tables computed in a forked child process (the parent's tokenizer data
    shared, copy on write), killed after ``seconds``: its Python work never holds this process's
    GIL, so the engine thread keeps its pace while a schema is prepared."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_first_tables, args=(data, schema, prompts, send), daemon=True,
                        name="speculant-prepare")
    with warnings.catch_warnings():  # Python's note that forking a threaded process is unsafe in general:
        warnings.simplefilter("ignore", DeprecationWarning)  # the child runs pure Python and exits
        child.start()
    send.close()
    try:
        if not receive.poll(seconds):
            raise SpeculantError(f"the JSON schema takes longer than {seconds:g} s to prepare: send a simpler one "
                                 "(fewer alternatives, a smaller schema)")
        try:
            kind, value = receive.recv()
        except (EOFError, OSError):
            raise SpeculantError("unusable JSON schema: it could not be prepared") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
    if kind != "ok":
        raise SpeculantError(value)
    return value


def json_schema_processor(tokenizer, schema: dict | None = None, eos_token_ids=None, prompts=None,
                          timeout: float | None = SCHEMA_SECONDS) -> SchemaProcessor:
    """A processor that forces the output to be JSON matching ``schema`` (any JSON object if None).
    ``eos_token_ids``: the tokens that may end the output once the JSON is complete. The schema is
    checked against the bounds of ``speculant.limits`` and prepared within ``timeout`` seconds (None:
    no limit): with ``prompts`` (the server) each prompt's first state, the costly part, is computed
    in a child process killed at the limit; without, the parser is built in a worker thread stopped
    at the limit."""
    try:
        import lmformatenforcer  # noqa: F401  (the structured extra, installed apart)
    except ImportError:
        raise SpeculantError("JSON-schema output needs lm-format-enforcer: pip install lm-format-enforcer") from None
    if tokenizer is None:
        raise SpeculantError("JSON-schema output needs the model's tokenizer")
    check_schema(schema)
    data = _tokenizer_data(tokenizer, eos_token_ids)  # once per tokenizer, outside the time limit
    prompts = [list(p) for p in prompts or ()]
    with _PREPARING:
        if timeout is None:
            return _build(data, schema, prompts)
        if prompts and "fork" in multiprocessing.get_all_start_methods():
            tables = _in_child(data, schema, prompts, timeout)
            proc = within(timeout, lambda: _build(data, schema, ()), "the JSON schema")
            for p, table in zip(prompts, tables):
                proc.seed(p, table)
            return proc
        return within(timeout, lambda: _build(data, schema, prompts), "the JSON schema")

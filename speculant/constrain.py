"""Constrained output through the logits-processor hook (``SamplingParams.logits_processors``).

A processor is ``fn(token_ids, logits) -> logits`` where ``token_ids`` is the full context (prompt,
output so far, and -- while drafting or verifying -- the draft tokens before this position). The
engine applies the same processors to the target's p and the drafter's q, each on its own context,
so masking stays lossless and drafts that obey the constraint keep being accepted.

JSON schema constraints use lm-format-enforcer (``pip install lm-format-enforcer``): its states
are keyed by the token prefix (here by a digest of it), so it answers for any draft prefix, not
only for the one sequence plain decoding would walk. A schema is bounded (``speculant.limits``:
size, nesting, alternatives) and prepared within a time limit. The server runs each request's
parser in a child process of its own (``schema_worker``): the prompts' first states, the costly
part, within the limit, then every state the output needs, so no parser work runs on the engine
thread or holds the GIL.
"""
from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable

import torch

from .errors import SpeculantError
from .schema_keywords import enforceable
from .schema_worker import SchemaWorker, host, serve, text_key
from .limits import (MAX_SCHEMA_ALTERNATIVES, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, SCHEMA_REQUEST_SECONDS, SCHEMA_SECONDS,
                     SCHEMA_STATE_SECONDS, SCHEMA_STATE_SHARE)


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


def _data_key(tokenizer, eos_token_ids) -> tuple:
    return id(tokenizer), tuple(sorted(eos_token_ids or ()))


def _tokenizer_data(tokenizer, eos_token_ids):
    """lm-format-enforcer's view of a tokenizer (its own transformers integration imports a module
    transformers 5 removed, so this is that function, rebuilt on the public tokenizer API)."""
    key = _data_key(tokenizer, eos_token_ids)
    if key not in _TOKENIZER_DATA:
        _TOKENIZER_DATA[key] = (tokenizer, _build_tokenizer_data(tokenizer, eos_token_ids))
    return _TOKENIZER_DATA[key][1]


def warm(tokenizer, eos_token_ids) -> None:
    """lm-format-enforcer's view of the tokenizer built now, where it is installed (~1 s and ~50 MB
    for a 49k vocabulary), and the process that forks each request's parser: a server does it as
    it starts, since done at its first schema that second of Python (and the fork) would hold the
    requests beside it."""
    try:
        import lmformatenforcer  # noqa: F401
    except ImportError:
        return
    if tokenizer is not None:
        _tokenizer_data(tokenizer, eos_token_ids)
        if "fork" in multiprocessing.get_all_start_methods():
            host(_data_key(tokenizer, eos_token_ids))  # forked now, with the data: the server never forks again


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


class _Watchdog:
    """Stops a thread's Python work at a deadline: inside ``limit(seconds)``, one daemon thread raises
    _Late in the watched thread once its deadline passes (at its next Python step), and again every
    AGAIN seconds while it stays inside (a raise that lands in a garbage collector's callback is
    swallowed there). Leaving ``limit`` clears a raise that has not landed yet, so none lands outside it."""

    AGAIN = 0.05

    def __init__(self):
        self._reset()
        # a forked child (a schema's parser: schema_worker) has none of its parent's threads: it
        # starts a watch thread of its own, with a lock no parent thread may have held at the fork
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self.cond = threading.Condition()
        self.deadlines: dict[int, float] = {}  # thread id -> when to raise _Late in it (monotonic)
        self.thread: threading.Thread | None = None

    @contextmanager
    def limit(self, seconds: float):
        tid = threading.get_ident()
        with self.cond:
            self.deadlines[tid] = time.monotonic() + seconds
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="speculant-schema-watch", daemon=True)
                self.thread.start()
            self.cond.notify()
        try:
            yield
        finally:
            with self.cond:
                self.deadlines.pop(tid, None)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)  # one not landed yet

    def _watch(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                for tid, deadline in list(self.deadlines.items()):
                    if deadline <= now:
                        self.deadlines[tid] = now + self.AGAIN
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_Late))
                self.cond.wait(min(self.deadlines.values()) - now if self.deadlines else None)


_WATCHDOG = _Watchdog()


_PREPARING = threading.Lock()  # one preparation at a time: two would halve each one's time, and the engine's


class SchemaProcessor:
    """A JSON-schema processor over lm-format-enforcer's parser, its states kept by a 128-bit digest
    of their token prefix (the library keys them by the whole prefix as a tuple: a copy of the text
    per state, quadratic in the output's length). ``prepare(prompt)`` builds a prompt's first state
    ahead (the server does, in a worker, before the engine sees the request)."""

    def __init__(self, enforcer, end_quietly: bool = False):
        self.enforcer = enforcer
        self.states: dict[tuple[int, bytes], object] = {}
        self.tables: dict[tuple[int, int], object] = {}  # distinct allowed-token tables
        # the parser's work while the output is written is bounded (speculant.limits): over it the
        # request fails; ``end_quietly`` (the server) ends its rows with EOS and says why in
        # ``failed`` (the scheduler tells the client, the batch's other rows go on), else it raises
        self.end_quietly = end_quietly
        self.failed: str | None = None
        self.spent, self.computed = 0.0, 0  # seconds of parser work, states computed
        self.dead_ends: set[tuple[int, bytes]] = set()  # texts where no token of the model goes on

    _key = staticmethod(text_key)

    def allowed(self, token_ids: list[int]) -> list[int]:
        """The token ids allowed after ``token_ids`` (the prompt, the output so far, drafts), each new
        state computed within the request's budget of parser work."""
        if self.failed is not None:
            return self._failed()
        state = self.states.get(self._key(token_ids))
        if state is not None:
            return state.allowed_tokens.allowed_tokens
        if not token_ids or self.states.get(self._key(token_ids[:-1])) is None:  # a prompt's: prepare's bound
            return self._bounded(token_ids, SCHEMA_SECONDS, f"a prompt's first state takes more than {SCHEMA_SECONDS:g} s")
        left = SCHEMA_REQUEST_SECONDS + SCHEMA_STATE_SHARE * self.computed - self.spent
        t0 = time.perf_counter()
        try:
            if left < SCHEMA_STATE_SECONDS:
                return self._bounded(token_ids, max(left, 0.0), f"the output needs more parser work than a request "
                                     f"may take ({SCHEMA_REQUEST_SECONDS:g} s and {SCHEMA_STATE_SHARE * 1000:g} ms a token)")
            return self._bounded(token_ids, SCHEMA_STATE_SECONDS,
                                 f"one token needs more than {SCHEMA_STATE_SECONDS:g} s of parser work")
        finally:
            self.spent += time.perf_counter() - t0
            self.computed += 1

    def _bounded(self, token_ids: list[int], seconds: float, over: str) -> list[int]:
        """_compute stopped after ``seconds``: past them the request has failed (``over`` says how)."""
        try:
            with _WATCHDOG.limit(seconds):
                return self._compute(token_ids)
        except _Late:
            self.failed = f"the JSON schema is too costly to follow: {over}; send a simpler one (fewer " \
                          "alternatives, no recursion through anyOf, simpler patterns)"
            return self._failed()

    def _failed(self) -> list[int]:
        if not self.end_quietly:
            raise SpeculantError(self.failed)
        return self._eos()

    def _eos(self) -> list[int]:
        eos = self.enforcer.eos_token_id
        return list(eos) if isinstance(eos, list) else [eos]

    def dead_end(self, token_ids: list[int]) -> bool:
        """Whether ``token_ids`` is a text where none of the model's tokens could go on (its row
        then ended there with EOS: the request has failed)."""
        return self._key(token_ids) in self.dead_ends

    def _compute(self, token_ids: list[int]) -> list[int]:
        """The state after ``token_ids`` from its parent's (the prompt's: the parser's first), kept."""
        enf = self.enforcer
        key = self._key(token_ids)
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
        """A prompt's first state, the costly part, outside the budget (its caller bounds it)."""
        if self.states.get(self._key(list(prompt))) is None:
            self._compute(list(prompt))

    @property
    def size(self) -> int:
        return len(self.states)

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = torch.tensor(self.allowed(token_ids), dtype=torch.long, device=logits.device)
        keep = keep[keep < logits.shape[-1]]
        if not len(keep) and self.end_quietly:  # none of the model's tokens goes on: a row that is here
            self.dead_ends.add(self._key(token_ids))  # ends (not its batch), and the scheduler says why;
            keep = torch.tensor(self._eos(), dtype=torch.long, device=logits.device)  # a draft's may never be
        # (without end_quietly a row that reaches such a text is refused: sampling's check of the processed logits)
        masked = torch.full_like(logits, float("-inf"))
        masked[keep] = logits[keep]
        return masked


# compiled patterns kept: lm-format-enforcer keeps them in one dict for the whole process, keyed by
# the pattern, which every schema a server prepares would otherwise grow for good
MAX_CACHED_PATTERNS = 256


def _compile_patterns(parser, schema) -> None:
    """Every ``pattern`` of the schema compiled now, within the preparation's time limit (the library
    compiles one when the output reaches its string: a slow one there would hold the engine)."""
    from lmformatenforcer.regexparser import RegexParser

    cache, todo = parser.context.regex_parser_cache, [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str) and pattern:  # trimmed as the library's string parser trims it
                pattern = pattern[1:] if pattern.startswith("^") else pattern
                pattern = pattern[:-1] if pattern.endswith("$") else pattern
                if pattern and pattern not in cache:
                    if len(cache) >= MAX_CACHED_PATTERNS:  # a live parser keeps its own; a new one compiles again
                        cache.clear()
                    cache[pattern] = RegexParser(pattern, parser.config)
            todo.extend(v for k, v in node.items() if k not in ("default", "examples", "const", "enum"))  # values
        elif isinstance(node, list):
            todo.extend(node)


def _build(data, schema: dict | None, prompts) -> SchemaProcessor:
    """The processor of ``schema`` with each prompt's first state computed; a SpeculantError naming
    what is wrong with a schema the library refuses."""
    from lmformatenforcer import JsonSchemaParser, TokenEnforcer

    try:
        proc = SchemaProcessor(TokenEnforcer(data, JsonSchemaParser(schema)))
        _compile_patterns(proc.enforcer.root_parser, schema)
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


def _held(schema: dict | None) -> dict | None:
    """The schema rewritten into forms whose every keyword the parser holds (or a SpeculantError
    naming the one it cannot), checked against the bounds again."""
    if schema is None:
        return None
    held = enforceable(schema)
    check_schema(held, "the JSON schema, rewritten into the forms the parser holds,")
    return held


def _parser_main(key, schema, prompts, conn) -> None:
    """In the request's parser process (``schema_worker.SchemaHost``): the schema as the parser
    holds it, the prompts' first states, then every state the output needs (``schema_worker.serve``),
    or why the schema is refused. ``key``: the tokenizer's data, which the host had when forked."""
    try:
        proc = _build(_TOKENIZER_DATA[key][1], _held(schema), prompts)
    except SpeculantError as e:
        conn.send(("refused", str(e)))
        return
    except BaseException:  # noqa: BLE001 -- the server says it in one line
        conn.send(("refused", "unusable JSON schema: it could not be prepared"))
        return
    serve(proc, prompts, conn)


def _in_child(key, schema, prompts, seconds: float) -> SchemaWorker:
    """The request's parser in a process of its own (``schema_worker``: forked by a small host
    process, the tokenizer data shared), its prompts' first states computed within ``seconds`` (it
    ends itself at the limit): its Python work never holds this process's GIL or the engine."""
    here = host(key).start(_parser_main, (key, schema, prompts), seconds)
    data = _TOKENIZER_DATA[key][1]
    kind, value = "refused", "unusable JSON schema: it could not be prepared"
    try:
        if not here.poll(seconds):
            value = f"the JSON schema takes longer than {seconds:g} s to prepare: send a simpler one (fewer " \
                    "alternatives, a smaller schema)"
        else:
            kind, value = here.recv()
    except (EOFError, OSError):
        pass
    if kind != "ok":
        here.close()
        raise SpeculantError(value)
    eos = data.eos_token_id
    return SchemaWorker(here, data.vocab_size, eos if isinstance(eos, list) else [eos], value, SCHEMA_STATE_SECONDS)


def json_schema_processor(tokenizer, schema: dict | None = None, eos_token_ids=None, prompts=None,
                          timeout: float | None = SCHEMA_SECONDS) -> "SchemaProcessor | SchemaWorker":
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
    # every keyword held (some rewritten into forms the parser holds) or refused: within the time
    # limit too (a pattern's automaton can take long to build)
    with _PREPARING:
        if timeout is None:
            return _build(data, _held(schema), prompts)
        if prompts and "fork" in multiprocessing.get_all_start_methods():
            return _in_child(_data_key(tokenizer, eos_token_ids), schema, prompts, timeout)
        return within(timeout, lambda: _build(data, _held(schema), prompts), "the JSON schema")

"""A JSON schema's parser in a process of its own (the server's): the engine never runs its work.

lm-format-enforcer is Python: a costly state (a recursive ``anyOf``, a long pattern) computed on
the engine thread holds every batch's pass and, through the GIL, the HTTP side. Here each request's
parser has a process of its own, forked by a small host process (``SchemaHost``, started as the
server starts) at the lowest CPU priority: it prepares the schema, then keeps the request's parser.
The engine's side, ``SchemaWorker``, is the request's logits processor:

- before a batch's verify the engine hands it the texts the pass will score (``prefetch``), and
  steps other batches until their tables have come (``ready``; ``connection`` to wait on);
- a table arrives once, packed to a bit a token (a state inside a JSON string allows ~all of the
  vocabulary), and is applied as a mask, bit for bit what the in-process processor gives;
- a drafter's q at a text whose state has not come yet is left unprocessed (a proposal only: the
  target's p is always processed, so the output is the same; the drafts are just less often right);
- the parser's budget (``speculant.limits``) is kept in the child; past it, or when the child does
  not answer within a state's bound, the request has failed: its rows end with EOS and ``failed``
  says why (the scheduler answers 422), as with the in-process processor.
"""
from __future__ import annotations

import ctypes
import gc
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import warnings
import weakref
from array import array
from contextlib import contextmanager
from multiprocessing import reduction

import numpy as np
import torch

from .errors import SpeculantError
from .limits import SCHEMA_STATE_SECONDS

ANSWER_GRACE = 1.0  # seconds past a state's bound the engine waits for the child before the request fails
_DRAFTING = threading.local()


@contextmanager
def drafting():
    """Processing inside it is a drafter's (q): a state not computed yet leaves it unprocessed."""
    before = getattr(_DRAFTING, "on", False)
    _DRAFTING.on = True
    try:
        yield
    finally:
        _DRAFTING.on = before


def serve(proc, prompts: list[list[int]], conn) -> None:
    """In the child: the prompts' first states (already computed by ``proc``), then each text the
    parent asks for, in order, answered as (key, table number, packed bits the first time a table
    is sent); past the parser's budget one ("failed", why) and the child ends."""
    numbers: dict[int, int] = {}  # id of a table's TokenList -> its number (the objects kept alive below)
    kept: list = []
    vocab = proc.enforcer.vocab_size

    def answer(ids: list[int]):
        proc.allowed(ids)
        key = text_key(ids)
        tokens = proc.states[key].allowed_tokens
        number = numbers.get(id(tokens))
        if number is not None:
            return key, number, None
        number = numbers[id(tokens)] = len(kept)
        kept.append(tokens)
        bits = np.zeros(vocab, dtype=bool)
        table = np.asarray(tokens.allowed_tokens, dtype=np.int64)
        bits[table[(table >= 0) & (table < vocab)]] = True
        return key, number, np.packbits(bits).tobytes()

    try:
        conn.send(("ok", [answer(list(p)) for p in prompts]))
        while True:
            alarm(0)
            try:
                wanted = conn.recv()
            except (EOFError, OSError):
                return  # the request is over
            alarm(len(wanted) * (SCHEMA_STATE_SECONDS + ANSWER_GRACE))  # past the budget's stop: work stuck in C
            conn.send(("states", [answer(ids) for ids in wanted]))
    except SpeculantError as e:  # the parser's budget: the request has failed
        _send(conn, ("failed", str(e)))
    except BaseException:  # noqa: BLE001 -- the parent says it in one line
        _send(conn, ("failed", "the JSON schema's parser failed on this output"))


def _send(conn, message) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass


class SchemaWorker:
    """A request's JSON-schema processor whose parser runs in a process of its own (see the module). Its
    interface is ``SchemaProcessor``'s where the engine and the scheduler read it: call it as a
    logits processor; ``failed``, ``dead_end``, ``end_quietly``. ``conn``: its connection to the
    parser's process (``SchemaHost.start``)."""

    def __init__(self, conn, vocab: int, eos: list[int], first: list, state_seconds: float = SCHEMA_STATE_SECONDS):
        self.conn, self.vocab, self.eos = conn, vocab, list(eos)
        self.state_seconds = state_seconds  # a state's bound: past it and ANSWER_GRACE without an answer, the request fails
        self.end_quietly = True
        self.failed: str | None = None
        self.closed = False  # its parser's process is told to end (the request is over, or has failed)
        self.known: dict = {}  # text key -> table number
        self.masks: list[torch.Tensor] = []  # table number -> bool [vocab]: the tokens allowed
        self.asked: set = set()  # keys asked for and not answered yet
        self.waiting_since: float | None = None  # when the oldest unanswered question went out
        self.dead_ends: set = set()
        self._keep(first)
        self._close = weakref.finalize(self, _stop, conn)

    # ---- the engine's side of the protocol ----
    def prefetch(self, texts: list[list[int]]) -> bool:
        """Ask the child for the states of ``texts`` (parents first, as a pass scores them) that it
        has not sent; whether all of them are here now (or the request has failed)."""
        self._receive()
        if self.closed:
            return True
        keys = [text_key(ids) for ids in texts]
        wanted = [(ids, k) for ids, k in zip(texts, keys) if k not in self.known and k not in self.asked]
        if wanted:
            try:
                self.conn.send([ids for ids, _ in wanted])
            except (OSError, ValueError):
                self._fail("the JSON schema's parser process has ended")
                return True
            self.asked.update(k for _, k in wanted)
            if self.waiting_since is None:
                self.waiting_since = time.monotonic()
        return all(k in self.known for k in keys) or self._overdue()

    def connection(self):
        """What to wait on (``multiprocessing.connection.wait``) until an answer comes."""
        return None if self.closed else self.conn

    def _overdue(self) -> bool:
        """Whether the child has not answered for longer than a state's bound: the request fails."""
        within = len(self.asked) * self.state_seconds + ANSWER_GRACE
        if self.waiting_since is not None and time.monotonic() - self.waiting_since > within:
            self._fail(f"the JSON schema is too costly to follow: its parser did not answer within {within:g} s; "
                       "send a simpler one")
            return True
        return False

    def _receive(self) -> None:
        """Take what the child has sent (never waits)."""
        try:
            while not self.closed and self.conn.poll(0):
                kind, value = self.conn.recv()
                if kind == "failed":
                    self._fail(value)
                else:
                    self._keep(value)
        except (EOFError, OSError):
            self._fail("the JSON schema's parser process has ended")

    def _keep(self, answers) -> None:
        for key, number, bits in answers:
            if bits is not None:
                mask = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=self.vocab).astype(bool)
                self.masks.append(torch.from_numpy(mask))
            self.known[key] = number
            self.asked.discard(key)
        self.waiting_since = time.monotonic() if self.asked else None

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
        self.close()

    def close(self) -> None:
        """The child ends (the request is over, or has failed); a text it had not answered then
        gets EOS alone."""
        self.closed = True
        self._close()

    # ---- the logits processor ----
    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        key = text_key(token_ids)
        number = self.known.get(key)
        if number is None and not self.closed:
            if getattr(_DRAFTING, "on", False):  # a drafter's q: a proposal needs no state (see the module)
                self.prefetch([token_ids])
                return logits
            self._wait_for(token_ids, key)
            number = self.known.get(key)
        width = logits.shape[-1]
        if number is None:  # failed (or over): the row ends, and the scheduler says why
            allowed = torch.zeros(width, dtype=torch.bool)
            allowed[[t for t in self.eos if t < width]] = True
        else:
            allowed = _fit(self.masks[number], width)
            if not bool(allowed.any()):  # none of the model's tokens goes on: the row ends here
                self.dead_ends.add(key)
                allowed = allowed.clone()
                allowed[[t for t in self.eos if t < width]] = True
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def _wait_for(self, token_ids: list[int], key) -> None:
        """A state the engine did not ask for ahead (a caller that does not prefetch): asked for
        and waited on, the GIL released while waiting."""
        self.prefetch([token_ids])
        while key not in self.known and not self.closed:
            self.conn.poll(0.05)
            self.prefetch([])

    def dead_end(self, token_ids: list[int]) -> bool:
        return text_key(token_ids) in self.dead_ends


def _fit(mask: torch.Tensor, width: int) -> torch.Tensor:
    """The mask over ``width`` logits: tokens past the tokenizer's are never allowed."""
    if mask.shape[0] >= width:
        return mask[:width]
    return torch.cat([mask, mask.new_zeros(width - mask.shape[0])])


def text_key(ids) -> tuple[int, bytes]:
    """A text's key: its length and a 128-bit digest of its tokens (the parser keys its states by
    the whole text, a copy per state: quadratic in the output's length)."""
    return len(ids), hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


def _stop(conn) -> None:
    """The request is over: its parser's process reads the end of its connection and exits (or
    its own alarm ends it, if it is in the middle of a state)."""
    try:
        conn.close()
    except OSError:
        pass


class SchemaHost:
    """A small process forked once (as a server starts, after the tokenizer's data is built) that
    forks each request's parser: the server itself never forks again (a fork copies its page
    tables and holds its GIL, and every page it writes afterwards is copied while a child lives).
    ``start(main, args, seconds)`` runs ``main(*args, conn)`` in a new parser process and returns
    this end of ``conn``; that process dies with the host, and the host with the server."""

    def __init__(self):
        ctx = multiprocessing.get_context("fork")
        self.conn, there = ctx.Pipe()
        self.lock = threading.Lock()
        with warnings.catch_warnings():  # forking a threaded process: the host runs pure Python
            warnings.simplefilter("ignore", DeprecationWarning)
            self.process = ctx.Process(target=_host_main, args=(there,), daemon=True, name="speculant-schema-host")
            self.process.start()
        there.close()

    def start(self, main, args: tuple, seconds: float):
        here, there = multiprocessing.get_context("fork").Pipe()
        try:
            with self.lock:
                self.conn.send((main, args, seconds))
                reduction.send_handle(self.conn, there.fileno(), self.process.pid)
        except (OSError, ValueError, EOFError):
            here.close()
            raise SpeculantError("the JSON schema could not be prepared: the server's schema process has ended") \
                from None
        finally:
            there.close()
        return here

    @property
    def alive(self) -> bool:
        return self.process.is_alive()


def _die_with_parent() -> None:
    """Linux: this process is killed when its parent ends (however it ends)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _host_main(conn) -> None:
    _die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the parsers' processes are reaped as they end
    gc.freeze()  # what it inherited: never touched by a collector (its children's pages stay shared)
    while True:
        try:
            main, args, seconds = conn.recv()
            fd = reduction.recv_handle(conn)
        except (EOFError, OSError):
            return  # the server has ended
        if os.fork() == 0:
            conn.close()
            _die_with_parent()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # the engine's passes go first
            except (AttributeError, OSError):
                pass
            alarm(seconds + ANSWER_GRACE)  # its preparation: ended even inside C
            try:
                main(*args, multiprocessing.connection.Connection(fd))
            finally:
                os._exit(0)
        os.close(fd)


def alarm(seconds: float) -> None:
    """In a parser's process: it ends once it has used ``seconds`` more of CPU time (0: never),
    whatever it is doing (SIGPROF's default action; CPU time, as it runs only when the engine's
    passes leave a core idle)."""
    signal.setitimer(signal.ITIMER_PROF, seconds)


_HOSTS: dict = {}  # (this process, what the host was forked with) -> SchemaHost


def host(key) -> SchemaHost:
    """This process's schema host for ``key`` (a tokenizer's data, built before: the host has what
    this process had when it forked), started at its first use (a server starts it as it starts)."""
    h = _HOSTS.get((os.getpid(), key))
    if h is None or not h.alive:
        h = _HOSTS[os.getpid(), key] = SchemaHost()
    return h


def workers() -> list[int]:
    """The parsers' processes alive (for the tests: none outlives its request)."""
    pids = []
    for (pid, _), h in list(_HOSTS.items()):
        if pid == os.getpid() and h.alive:
            try:
                with open(f"/proc/{h.process.pid}/task/{h.process.pid}/children") as f:
                    pids += [int(p) for p in f.read().split()]
            except OSError:
                pass
    return pids


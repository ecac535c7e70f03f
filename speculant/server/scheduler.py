"""One owner thread runs the engine; requests wait in a queue and compatible ones share a batch.

Every request becomes one *job* per choice (``n`` choices: ``n`` jobs). The owner thread is the only
code that touches the Generator (its engine, KV caches and drafter state), so concurrent clients
never share mutable state. It starts a batch with the oldest waiting job and, up to
``max_batch_size``, the waiting jobs of the same *group* (the same γ setting, and processing that
reads the text in the same forms; temperature, top-k/p, penalty strengths, seeds and logprobs are
per row, and a seeded job's text does not depend on what shares its batch). Between passes,
jobs of that group that arrived meanwhile are prefilled and **join the running batch** (continuous
batching), as long as there is room and the drafter can take rows of another batch; jobs of
another group start a batch of their own **beside it** (up to ``max_batches``, each with its own
caches and drafter state: the engine shares its time between them fairly, the batch that has had
the least going next), so a long request of one kind
(a JSON schema's, say) never holds the others for its whole length. Rows leave as they finish
(EOS, stop, length, cancel) and their client hears at once.

A job's tokens reach its ``sink`` as they are accepted: ("tokens", Emitted), then ("done", Output)
or ("error", message) (a ``Refused`` message: the request's own fault, with its HTTP status). Sinks
are called from the owner thread and must not block.

Nothing one request sends holds the others: a job past its deadline (``request_timeout`` from its
arrival) leaves its batch or the queue; a job whose JSON schema has used its budget of parser work
(``SchemaProcessor.failed``) ends with that error while its batch goes on; and ``stalled()`` says
when no pass has ended for a while (``/health``).

Memory (``memory_budget``, bytes; None: not counted): one account for the server. A batch is
charged what its caches (target and drafter, every row at the batch's longest size), a pass's
logits and its rows' buffers take (``Generator.memory_needed``), from its start to its end (a
finished row's cache stays part of the batch's until a join rebuilds it); waiting requests are
counted by what they will need. A batch starts with, and takes in, only the waiting jobs that keep
the total within the budget, less a share kept for what the account does not count (a join is
counted at its peak: the larger of the caches before and after, and the joiners' own); the others
wait their turn. ``submit`` refuses a request whose wait
would be long (what waits ahead of it and its own need pass the budget) with ``MemoryBusy`` and a
Retry-After estimate. A job that does not fit yet does not hold the smaller ones behind it while
it has waited less than HOLD_AFTER seconds (then they wait behind it, so it is not starved); one
that has waited MEMORY_WAIT seconds is refused (429). When a batch ends its memory goes back to the
system (``malloc_trim``).
"""
from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..engine import WAITING
from ..errors import SpeculantError
from ..limits import gib

log = logging.getLogger("speculant.server")
BATCH_SETTINGS = ("gamma", "speculate")  # what a batch's rows share; the rest of Job.sampling is per row
TRIM_AFTER = 32 * 2**20  # a batch start or join charged this much trims the C heap after its prefill
MAX_ROWS_PER_BATCH = 1024  # rows one batch admits in its life: a batch keeps its finished rows until it ends
LONG_PROMPT = 128  # tokens: a longer prompt is prefilled in steps, in a batch of its own
PREFILL_SLICE = 0.015  # seconds a step of its prefill should take: the wait of a request that comes meanwhile
PREFILL_TOKENS = (4, 256)  # the fewest and the most prompt tokens a step
LONG_WEIGHT = 3.0  # a long prompt's batch's time (its prefill's steps, its passes) counts 3 times: the others get 3/4
HOLD_AFTER = 10.0  # seconds a job that does not fit the memory lets smaller later ones go first
MEMORY_WAIT = 60.0  # seconds a job may wait for memory before it is refused
WAIT_SLICE = 0.005  # seconds the engine waits at most for a processing's answer when every batch waits


class Refused(str):
    """An error event's message that is the request's own doing (its HTTP status: a 4xx)."""

    def __new__(cls, message: str, status: int = 400):
        self = super().__new__(cls, message)
        self.status = status
        return self


def _error_message(e: Exception, what: str) -> str:
    """What a client is told of a failure: our one-line errors as they are; anything else is an
    internal error, logged with its traceback."""
    if isinstance(e, SpeculantError):
        return str(e)
    log.exception(what)
    return "internal error while generating: the server's log has the details"


class QueueFull(SpeculantError):
    retry_after: int | None = None


class MemoryBusy(QueueFull):
    """The server's memory is taken by running and waiting requests for longer than a short wait."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): freed tensors below
    its mmap threshold (which rises to 32 MiB once large blocks are freed) stay resident otherwise."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc: nothing to trim
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sink: Callable[[tuple], None]
    stop: list[str] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # SamplingParams fields, logprobs, gamma
    seed: int | None = None  # this job's own (a request's choice i: row_seed(seed, i))
    group: object = None  # jobs with equal groups may share a batch
    cancelled: bool = False
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    reported: bool = False  # its done (or error) event went out
    extra: int = 0  # bytes it holds beside its caches and logits (buffers, a schema's tables)
    need: int = 0  # its share of its request's memory (what it counts for while it waits)
    deadline: float | None = None  # monotonic time after which it is dropped (Scheduler.request_timeout)

    def failure(self, row=None) -> str | None:
        """Why its processing gave up (a JSON schema past its budget of parser work, or its ``row``
        ended where no token of the model could go on), or None."""
        for fn in self.sampling.get("logits_processors") or ():
            if getattr(fn, "failed", None):
                return fn.failed
            if row is not None and row.finished and row.tokens and hasattr(fn, "dead_end") \
                    and fn.dead_end(row.prompt + row.tokens[:-1]):
                return "the JSON schema cannot be followed with this model's tokens: none of them could go on " \
                       "where its output had come to"
        return None


@dataclass
class _Running:
    """A batch the engine steps: its group, its rows' jobs (jobs[r]: row r's), the bytes it is
    charged and the rows it has admitted in its life."""

    group: object
    jobs: list[Job]
    batch: object  # None while its prefill runs a chunk at a time
    charge: int = 0
    admitted: int = 0
    prefill: object = None  # engine.start_steps' generator, until the batch is prefilled
    chunk: int = 0  # prompt tokens its prefill's step in progress takes
    used: float = 0.0  # the engine's seconds it has had (a long prompt's weighted), against the others'
    weight: float = 1.0  # what a second of its counts in ``used``
    token_seconds: float = 0.0  # its prefill's seconds a prompt token, as measured (0: not yet)
    step: object = None  # engine.step's generator while it waits for its processing's answers (WAITING)

    def live(self) -> list[Job]:
        return [self.jobs[r] for r in self.batch.active]


class Scheduler:
    def __init__(self, generator, max_batch_size: int = 32, max_queue: int = 256, on_done=None, on_pass=None,
                 memory_budget: int | None = None, request_timeout: float | None = None, max_batches: int = 4):
        if max_batch_size < 1 or max_queue < 1 or max_batches < 1:
            raise SpeculantError("max_batch_size, max_queue and max_batches must be >= 1")
        self.gen = generator
        self.max_batch_size, self.max_queue, self.max_batches = max_batch_size, max_queue, max_batches
        self.batches: list[_Running] = []  # the batches the engine steps (its thread's alone)
        # a long prompt is prefilled a chunk at a time between the running batches' passes
        self.chunks = hasattr(getattr(generator, "engine", None), "start_steps")
        self.memory_budget = memory_budget  # bytes, server-wide (None: not counted)
        self.request_timeout = request_timeout  # seconds from a job's arrival to its drop (None: none)
        self.progress_at = time.monotonic()  # the last pass's end, or when the engine last went idle
        self.held = 0  # bytes charged to the running batch
        self.peak = 0  # the most bytes charged at once (running, joining, idle caches), for the tests
        self.pass_seconds = 0.0  # a pass's time, averaged (Retry-After estimates)
        self.passes_left = 0  # the running batch's most tokens still to come
        self.stepping = False  # a batch is running (until its caches are given back)
        self.on_done = on_done  # callable(jobs, outputs): metrics of finished jobs
        self.on_pass = on_pass  # callable(rows): metrics of each pass's batch size
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.lock = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="speculant-engine", daemon=True)
        self.thread.start()

    def submit(self, jobs: list[Job], need: int = 0) -> None:
        """Queue a request's jobs, all or none: QueueFull when the queue has no room, MemoryBusy when
        the memory its jobs ``need`` (bytes, all of them) would wait long for."""
        with self.lock:
            if self.closed:
                raise SpeculantError("the server is shutting down")
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting): retry later")
            if self.memory_budget is not None and need:
                ahead = sum(j.need for j in self.waiting)
                if ahead + need > self.memory_budget:  # more than one turn of the running batch's memory
                    retry = self._retry_after()
                    raise MemoryBusy(f"the server's memory is taken by running and waiting requests (this one needs "
                                     f"{gib(need)}, {gib(self.held + ahead)} of {gib(self.memory_budget)} are taken or "
                                     f"promised): retry in about {retry} s", retry)
                for j in jobs:
                    j.need = need // len(jobs)
            for j in jobs:
                if j.deadline is None and self.request_timeout is not None:
                    j.deadline = j.queued_at + self.request_timeout
            self.waiting.extend(jobs)
            self.lock.notify()

    def _retry_after(self) -> int:
        """Seconds until the memory now taken is likely free: the running batch's passes left and the
        longest waiting request's, at the passes' average time."""
        longest = max((j.max_tokens for j in self.waiting), default=0)
        return int(min(600, max(1, math.ceil(self.pass_seconds * (self.passes_left + longest)))))

    # ---- the memory account (engine thread) ----
    def charge(self, jobs: list[Job]) -> int:
        """Bytes a batch of these jobs holds at most: every row's caches at the longest row's size,
        a pass's logits, and the rows' buffers."""
        if not jobs or self.memory_budget is None:
            return 0
        s = jobs[0].sampling
        gamma = 0 if not s.get("speculate", True) else (s.get("gamma") if s.get("gamma") is not None else self.gen.gamma)
        return self.gen.memory_needed(len(jobs), max(len(j.prompt) for j in jobs), max(j.max_tokens for j in jobs),
                                      gamma) + sum(j.extra for j in jobs)

    # the share of the budget batches leave for what the account does not count (the C heap's slack,
    # the requests' own Python objects): with none, RSS once grew 257.9 MiB against a 256 MiB budget
    # whose account peaked within it (tests/test_server_memory.py)
    UNCOUNTED_SHARE = 0.05

    def _room(self) -> int:
        """Bytes the running batch may still take: the budget less its uncounted share and what idle
        caches keep (given back first where they are in the way)."""
        idle = self.gen.idle_bytes() if hasattr(self.gen, "idle_bytes") else 0
        return int(self.memory_budget * (1 - self.UNCOUNTED_SHARE)) - idle

    def _fits(self, taken: list[Job], job: Job, run: "_Running | None" = None) -> bool:
        """Whether ``job`` may join ``taken`` (a batch about to start beside the running ones, or
        joiners of the running batch ``run``) within the budget."""
        if self.memory_budget is None:
            return True
        group = taken + [job]
        total = self.held + self.charge(group) if run is None else self._join_peak(run, group)
        if total > self._room() and hasattr(self.gen, "drop_idle"):
            self.gen.drop_idle()
        return total <= self._room()

    def _join_peak(self, run: "_Running", joiners: list[Job]) -> int:
        """The most a join holds at once: the other batches', the larger of this batch's caches
        before and after (they are rebuilt a layer at a time; a new layer's keys or values, a row
        larger than the old ones, fit in no hole until two old ones are freed beside each other: a
        layer more), and the joiners' own batch with its prefill."""
        after = self.charge(run.live() + joiners)
        layers = getattr(getattr(getattr(self.gen, "target", None), "model", None), "config", None)
        layers = getattr(layers, "num_hidden_layers", None) or 1
        return self.held - run.charge + max(run.charge, after) + after // layers + self.charge(joiners)

    def _charged(self, peak: int = 0) -> None:
        """The running batches' caches now hold what their charges say (``peak``: what a join just held)."""
        if self.memory_budget is None:
            return
        idle = self.gen.idle_bytes() if hasattr(self.gen, "idle_bytes") else 0
        self.held = sum(run.charge for run in self.batches)
        self.peak = max(self.peak, idle + self.held, idle + peak)

    def cancel(self, jobs: list[Job]) -> None:
        """End these jobs: waiting ones leave the queue, running ones leave their batch after this pass."""
        with self.lock:
            for j in jobs:
                j.cancelled = True
                if j in self.waiting:
                    self.waiting.remove(j)

    def queue_depth(self) -> int:
        return len(self.waiting)

    def batch_size(self) -> int:
        return sum(not j.cancelled for j in self.running)

    def idle(self) -> bool:
        """No batch runs and none waits: every batch's memory has gone back."""
        return not self.stepping and not self.waiting

    def close(self, timeout: float = 10.0) -> None:
        with self.lock:
            self.closed = True
            for j in self.running:
                j.cancelled = True
            self.lock.notify()
        self.thread.join(timeout)

    def stalled(self, seconds: float) -> bool:
        """A batch runs and no pass of it has ended for ``seconds``."""
        return self.stepping and time.monotonic() - self.progress_at > seconds

    def _expire(self) -> None:
        """Refuse the waiting jobs past their deadline or their wait for memory (lock held)."""
        now = time.monotonic()
        for j in list(self.waiting):
            if j.deadline is not None and now > j.deadline:
                why = Refused(f"the request waited longer than its time limit ({self.request_timeout:g} s) for "
                              "its turn: retry later", 408)
            elif (self.memory_budget is not None and now - j.queued_at > MEMORY_WAIT
                  and self.held + self.charge([j]) > self._room()):
                why = Refused(f"the request waited {MEMORY_WAIT:g} s for memory the running requests hold: retry "
                              "later, or ask for fewer tokens or choices", 429)
            else:
                continue
            self.waiting.remove(j)
            j.cancelled = j.reported = True
            j.sink(("error", why))

    def _next_batch(self) -> list[Job]:
        with self.lock:
            while not self.closed:
                self._expire()
                if self.waiting:
                    break
                self.progress_at = time.monotonic()
                self.lock.wait()
            if self.closed:
                return []
            self.progress_at = time.monotonic()
            first = self.waiting.popleft()
            if self.memory_budget is not None and self.charge([first]) > self._room():
                self.gen.drop_idle()
            return [first] + self._take(first.group, self.max_batch_size - 1, [first],
                                        like=first.prompt if self._long(first) else None)

    def _long(self, job: Job) -> bool:
        """A prompt prefilled in chunks: in a batch of its own (its request's other choices beside it)."""
        return self.chunks and len(job.prompt) > LONG_PROMPT

    def _take(self, group, room: int, base: list[Job], run: "_Running | None" = None,
              like: list[int] | None = None) -> list[Job]:
        """Up to ``room`` waiting jobs of ``group`` in their order, while the memory account lets them
        join ``base`` (the jobs of a batch about to start; or, with ``run``, joiners of that running
        batch: see _fits), out of the queue and into the running set (lock held). ``like``: only jobs
        of that prompt (a long one's batch), else no long ones."""
        picked: list[Job] = []
        now = time.monotonic()
        for j in [j for j in self.waiting if j.group == group and (j.prompt == like if like is not None
                                                                  else not self._long(j))]:
            if len(picked) >= room:
                break
            if not self._fits(base + picked, j, run):
                if now - j.queued_at >= HOLD_AFTER:
                    break  # it has waited long enough: the later ones wait behind it
                continue  # smaller ones behind it may fit meanwhile
            picked.append(j)
        for j in picked:
            self.waiting.remove(j)
        self.running += picked
        return picked

    def _loop(self) -> None:
        while True:
            jobs = self._next_batch()
            if not jobs:
                return
            with self.lock:
                self.running = list(jobs)
                self.stepping = True
            try:
                self._run(jobs)
            except Exception as e:  # keep serving: report it to this batch's clients (and the log)
                self._fail(_error_message(e, "batch failed"))
            finally:
                with self.lock:
                    self.running = []
                del jobs  # nothing of the batch outlives it here (its caches went with engine.finish)
                self.batches = []
                self._charged()
                trim_heap()
                self.stepping = False

    def _fail(self, message: str, jobs: list[Job] | None = None) -> None:
        """Tell these jobs (default: every running one) that their request failed."""
        with self.lock:
            jobs = list(self.running) if jobs is None else jobs
            self.running = [j for j in self.running if j not in jobs]
        for j in jobs:
            if not j.reported:
                j.reported = True
                j.sink(("error", message))
        self._release(jobs)

    def _release(self, jobs: list[Job]) -> None:
        """The processes of these ended jobs' processors (a JSON schema's parser) end, once no job
        that shares them (a request's other choices) runs or waits."""
        with self.lock:
            live = {id(f) for j in (*self.running, *self.waiting) if not j.reported
                    for f in j.sampling.get("logits_processors") or ()}
        for j in jobs:
            for f in j.sampling.get("logits_processors") or ():
                if id(f) not in live and callable(getattr(f, "close", None)):
                    f.close()

    def _start(self, jobs: list[Job], chunk: int = 0):
        t0 = time.monotonic()
        for j in jobs:
            j.started_at = t0
        shared = {k: jobs[0].sampling[k] for k in BATCH_SETTINGS if k in jobs[0].sampling}  # equal in a group
        rows = [{k: v for k, v in j.sampling.items() if k not in shared} for j in jobs]
        more = {"chunk": chunk} if chunk else {}  # then engine.start_steps' generator, not the batch
        return self.gen.start_batch([j.prompt for j in jobs], [j.max_tokens for j in jobs], [j.stop for j in jobs],
                                    seed=[j.seed for j in jobs], cancelled=lambda r: jobs[r].cancelled,
                                    row_sampling=rows, **shared, **more)

    def _run(self, first: list[Job]) -> None:
        """Step the running batches until the last one ends: ``first``'s and those that start beside
        it (another group's, up to ``max_batches``), taking in waiting jobs between passes. The
        engine's time is shared fairly: the batch that has had the least of it goes next (a pass,
        or a step of a long prompt's prefill; a long prompt's batch's time counts LONG_WEIGHT
        times), so a batch of cheap passes is not held a costly pass each turn by one of a long
        context; a pass that waits for its processing's answers goes on once they have come."""
        self.batches = []
        self._launch(first, alone=True)
        try:
            while self.batches:
                self._admit()
                for run in [r for r in self.batches if r.step is not None]:  # answers come? (a poll each)
                    self._timed(run, self._pass)
                ready = [r for r in self.batches if r.step is None]
                if ready:
                    run = min(ready, key=lambda r: r.used)
                    if run.prefill is not None:
                        self._timed(run, self._advance)
                    else:
                        self._timed(run, self._pass)
                else:  # every batch waits: until an answer (or a job) comes
                    self.gen.engine.wait([r.batch for r in self.batches], WAIT_SLICE)
        finally:
            for run in list(self.batches):  # a failure: their caches go back (their jobs hear of it)
                self._end(run)

    @staticmethod
    def _timed(run: "_Running", work) -> None:
        t0 = time.monotonic()
        work(run)
        run.used += (time.monotonic() - t0) * run.weight

    def _admit(self) -> None:
        """Waiting jobs into the running batches (continuous batching) or into new ones beside them."""
        while True:
            with self.lock:
                action = self._next_action()
            if action is None:
                return
            run, jobs = action
            if run is None:
                self._launch(jobs)
            else:
                self._join(run, jobs)

    def _next_action(self) -> "tuple[_Running | None, list[Job]] | None":
        """The waiting jobs to admit next (lock held): the oldest group's that a batch of it can take
        or that may start a batch of their own (fewer than ``max_batches`` run), within the memory
        account; a group that cannot is passed over while its oldest job has waited less than
        HOLD_AFTER (and while batches are free to start), else everything behind it waits."""
        self._expire()
        if self.closed:
            return None
        seen, now = set(), time.monotonic()
        for j in list(self.waiting):
            if j.group in seen:
                continue
            seen.add(j.group)
            if any(r.group == j.group and r.step is not None for r in self.batches):
                continue  # its batch is inside a pass (waiting for a schema's parser): joins at its next turn
            run = next((r for r in self.batches if r.group == j.group and r.batch is not None
                        and r.batch.accepts_rows and r.admitted < MAX_ROWS_PER_BATCH), None)
            if run is not None and not self._long(j):  # joins its group's batch (rows it admits: bounded)
                room = min(self.max_batch_size - len(run.batch.active), MAX_ROWS_PER_BATCH - run.admitted)
                picked = self._take(j.group, room, [], run)
            elif len(self.batches) < self.max_batches:  # a batch of its own, beside the running ones
                run = None
                picked = self._take(j.group, self.max_batch_size, [], like=j.prompt if self._long(j) else None)
            else:
                return None  # no batch may start: this group waits for one to end, and those behind it too
            if picked:
                return run, picked
            if now - j.queued_at >= HOLD_AFTER:
                return None  # it has waited long enough for memory: the later ones wait behind it
        return None

    def _launch(self, jobs: list[Job], alone: bool = False) -> None:
        """Start a batch of these jobs (charged from its prefill on). A failure fails them alone,
        or (``alone``: the first batch) is raised."""
        run = _Running(jobs[0].group, list(jobs), None, self.charge(jobs), len(jobs))
        # its share from now on, none of the past, and a head start: a short request that comes
        # beside a long one runs at once, not after the long one's next step
        run.used = min((r.used for r in self.batches), default=0.0) - LONG_WEIGHT * PREFILL_SLICE
        run.weight = LONG_WEIGHT if self._long(jobs[0]) else 1.0
        self.batches.append(run)
        self._charged()
        try:
            if self._long(jobs[0]):  # prefilled a chunk at a time (_advance), other batches' passes between
                run.prefill = self._start(jobs, lambda: self._chunk_tokens(run))
                return
            run.batch = self._start(jobs)
        except Exception as e:
            self.batches.remove(run)
            self._charged()
            if alone:
                raise
            self._fail(_error_message(e, "starting requests failed"), jobs)
            return
        if self.held >= TRIM_AFTER:  # a large prefill's activations: back to the system, not kept by the allocator
            trim_heap()

    def _join(self, run: "_Running", joiners: list[Job]) -> None:
        """Prefill ``joiners`` and take them into ``run``'s batch; a failure fails them alone."""
        try:
            joined = self._start(joiners)
        except Exception as e:  # only the joiners fail; the running rows go on
            self._fail(_error_message(e, "joining requests failed"), joiners)
            return
        peak = self._join_peak(run, joiners) if self.memory_budget is not None else 0
        self.gen.engine.join(run.batch, joined)
        run.jobs += joiners
        run.admitted += len(joiners)
        if self.memory_budget is not None:  # the caches the join replaced go back (not kept for reuse)
            self.gen.drop_idle()
            run.charge = self.charge(run.live())
            self._charged(peak)
            if self.held >= TRIM_AFTER:  # the replaced caches' pages: a larger cache fits no hole
                trim_heap()

    def _chunk_tokens(self, run: "_Running") -> int:
        """Prompt tokens for ``run``'s next prefill step: as many as take PREFILL_SLICE seconds at the
        pace its steps have had (a token costs more as the prompt grows: attention), so a request
        that comes meanwhile waits about that long for its turn."""
        least, most = PREFILL_TOKENS
        tokens = least if not run.token_seconds else int(PREFILL_SLICE / run.token_seconds)
        run.chunk = max(least, min(most, tokens))
        return run.chunk

    def _advance(self, run: "_Running") -> None:
        """One chunk of ``run``'s prefill (its batch starts once the last is done); a failure fails
        its jobs alone, and one whose jobs have all left or run out of time stops."""
        now = time.monotonic()
        if all(j.cancelled or (j.deadline is not None and now > j.deadline) for j in run.jobs):
            late = [j for j in run.jobs if not j.cancelled]
            self._end(run)
            self._fail(Refused(f"the request took longer than its time limit ({self.request_timeout:g} s)", 408),
                       late)
            with self.lock:  # the cancelled ones' clients are gone: nothing to tell them
                self.running = [j for j in self.running if j not in run.jobs]
            for j in run.jobs:
                j.reported = True
            return
        t0 = time.perf_counter()
        try:
            next(run.prefill)
            seconds = (time.perf_counter() - t0) / max(1, run.chunk)
            run.token_seconds = seconds if not run.token_seconds else 0.5 * (run.token_seconds + seconds)
        except StopIteration as done:
            run.batch, run.prefill = done.value, None
            if self.held >= TRIM_AFTER:  # a large prefill's activations: back to the system
                trim_heap()
        except Exception as e:
            message = _error_message(e, "starting requests failed")
            run.prefill = None
            self.batches.remove(run)
            self._charged()
            self._fail(message, run.jobs)
        self.progress_at = time.monotonic()

    def _pass(self, run: "_Running") -> bool:
        """One pass of ``run``'s batch; its ended rows' jobs hear at once; an ended batch goes.
        A failure fails its jobs alone. False where the pass waits for its processing's answers
        (a JSON schema's parser): it goes on at the batch's next turn."""
        t0 = time.monotonic()
        steps, run.step = run.step or self.gen.engine.step(run.batch), None
        try:
            for item in steps:
                if item is WAITING:
                    run.step = steps
                    self._drop_failed(run)
                    return False
                r, new = item
                if not run.jobs[r].reported:
                    run.jobs[r].sink(("tokens", new))
        except Exception as e:  # keep serving: this batch's clients hear of it (and the log)
            message = _error_message(e, "batch failed")
            self._end(run)
            self._fail(message, [j for j in run.jobs if not j.reported])
            return True
        self.progress_at = time.monotonic()
        self._paced(run.batch, self.progress_at - t0)
        self._drop_failed(run)
        self._report(run.batch, run.jobs)
        if self.on_pass is not None and run.batch.active:
            self.on_pass(len(run.batch.active))
        if run.batch.done:
            self._end(run)
        return True

    def _end(self, run: "_Running") -> None:
        """Finish ``run``'s batch: its caches and drafter go back, its ended rows' jobs hear."""
        self.batches.remove(run)
        if run.step is not None:  # a pass that waited: it will not go on
            run.step.close()
            run.step = None
        if run.batch is None:  # its prefill had not ended: closing it gives back what it took
            if run.prefill is not None:
                run.prefill.close()
            self._charged()
            return
        try:
            self.gen.engine.finish(run.batch)
        finally:
            self._report(run.batch, run.jobs)
            self._charged()

    def _drop_failed(self, run: "_Running") -> None:
        """End the running jobs whose schema gave up or whose deadline passed: their rows leave the
        batch at its next pass, the others go on."""
        now, rows = time.monotonic(), getattr(run.batch, "rows", [])
        for r, j in enumerate(run.jobs):
            if j.reported:
                continue
            why = j.failure(rows[r] if r < len(rows) else None)
            if why is not None:
                why = Refused(why, 422)
            elif j.deadline is not None and now > j.deadline:
                why = Refused(f"the request took longer than its time limit ({self.request_timeout:g} s)", 408)
            if why is not None:
                j.cancelled = True
                self._fail(why, [j])

    def _paced(self, batch, seconds: float) -> None:
        """A pass's time and the batch's most tokens to come (Retry-After estimates)."""
        if self.memory_budget is None:
            return
        self.pass_seconds = seconds if not self.pass_seconds else 0.8 * self.pass_seconds + 0.2 * seconds
        rows = getattr(batch, "rows", [])
        self.passes_left = max((rows[r].limit - len(rows[r].tokens) for r in batch.active if r < len(rows)), default=0)

    def _report(self, batch, jobs: list[Job]) -> None:
        """Tell the jobs whose rows have ended."""
        ended = [r for r, row in enumerate(batch.rows) if row.finished and not jobs[r].reported]
        if not ended:
            return
        outputs = self.gen.outputs([batch.rows[r] for r in ended], [jobs[r].stop for r in ended])
        for r, out in zip(ended, outputs):
            jobs[r].reported = True
            jobs[r].sink(("done", out))
        with self.lock:
            self.running = [j for j in self.running if not j.reported]
        self._release([jobs[r] for r in ended])
        if self.on_done is not None:
            self.on_done([jobs[r] for r in ended], outputs)

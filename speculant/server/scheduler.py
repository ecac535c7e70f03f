"""One owner thread runs the engine; requests wait in a queue and compatible ones share a batch.

Every request becomes one *job* per choice (``n`` choices: ``n`` jobs). The owner thread is the only
code that touches the Generator (its engine, KV caches and drafter state), so concurrent clients
never share mutable state. It starts a batch with the oldest waiting job and, up to
``max_batch_size``, the waiting jobs of the same *group* (the same γ setting, and processing that
reads the text in the same forms; temperature, top-k/p, penalty strengths, seeds and logprobs are
per row, and a seeded job's text does not depend on what shares its batch). Between passes,
jobs of that group that arrived meanwhile are prefilled and **join the running batch** (continuous
batching), as long as there is room and the drafter can take rows of another batch; rows leave
as they finish (EOS, stop, length, cancel) and their client hears at once.

A job's tokens reach its ``sink`` as they are accepted: ("tokens", Emitted), then ("done", Output)
or ("error", message). Sinks are called from the owner thread and must not block.

Memory (``memory_budget``, bytes; None: not counted): one account for the server. A batch is
charged what its caches (target and drafter, every row at the batch's longest size), a pass's
logits and its rows' buffers take (``Generator.memory_needed``), from its start to its end (a
finished row's cache stays part of the batch's until a join rebuilds it); waiting requests are
counted by what they will need. A batch starts with, and takes in, only the waiting jobs that keep
the total within the budget, less a share kept for what the account does not count (a join is
counted at its peak: the larger of the caches before and after, and the joiners' own); the others
wait their turn. ``submit`` refuses a request whose wait
would be long (what waits ahead of it and its own need pass the budget) with ``MemoryBusy`` and a
Retry-After estimate. When a batch ends its memory goes back to the system (``malloc_trim``).
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

from ..errors import SpeculantError
from ..limits import gib

log = logging.getLogger("speculant.server")
BATCH_SETTINGS = ("gamma", "speculate")  # what a batch's rows share; the rest of Job.sampling is per row
TRIM_AFTER = 32 * 2**20  # a batch start or join charged this much trims the C heap after its prefill
MAX_ROWS_PER_BATCH = 1024  # rows one batch admits in its life: a batch keeps its finished rows until it ends


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


class Scheduler:
    def __init__(self, generator, max_batch_size: int = 32, max_queue: int = 256, on_done=None, on_pass=None,
                 memory_budget: int | None = None):
        if max_batch_size < 1 or max_queue < 1:
            raise SpeculantError("max_batch_size and max_queue must be >= 1")
        self.gen = generator
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.memory_budget = memory_budget  # bytes, server-wide (None: not counted)
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

    def _fits(self, taken: list[Job], job: Job, running: list[Job] | None = None) -> bool:
        """Whether ``job`` may join ``taken`` (a batch about to start, or joiners of a running batch
        whose live rows are ``running``) within the budget."""
        if self.memory_budget is None:
            return True
        group = taken + [job]
        total = self.charge(group) if running is None else self._join_peak(running, group)
        if total > self._room() and hasattr(self.gen, "drop_idle"):
            self.gen.drop_idle()
        return total <= self._room()

    def _join_peak(self, running: list[Job], joiners: list[Job]) -> int:
        """The most a join holds at once: the larger of the batch's caches before and after (they
        are rebuilt a layer at a time; a new layer's keys or values, a row larger than the old ones,
        fit in no hole until two old ones are freed beside each other: a layer more), and the
        joiners' own batch with its prefill."""
        after = self.charge(running + joiners)
        layers = getattr(getattr(getattr(self.gen, "target", None), "model", None), "config", None)
        layers = getattr(layers, "num_hidden_layers", None) or 1
        return max(self.held, after) + after // layers + self.charge(joiners)

    def _charged(self, jobs: list[Job], joining: list[Job] | None = None) -> None:
        """The running batch's cache now holds these jobs' rows (``joining``: those that just joined)."""
        if self.memory_budget is None:
            return
        idle = self.gen.idle_bytes() if hasattr(self.gen, "idle_bytes") else 0
        if joining is not None:
            self.peak = max(self.peak, idle + self._join_peak([j for j in jobs if j not in joining], joining))
        self.held = self.charge(jobs)
        self.peak = max(self.peak, idle + self.held)

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

    def _next_batch(self) -> list[Job]:
        with self.lock:
            while not self.waiting and not self.closed:
                self.lock.wait()
            if self.closed:
                return []
            first = self.waiting.popleft()
            if self.memory_budget is not None and self.charge([first]) > self._room():
                self.gen.drop_idle()
            return [first] + self._take(first.group, self.max_batch_size - 1, [first])

    def _take(self, group, room: int, base: list[Job], running: list[Job] | None = None) -> list[Job]:
        """Up to ``room`` waiting jobs of ``group`` in their order, while the memory account lets them
        join ``base`` (the jobs of a batch about to start; or, with ``running``, the live jobs of the
        running batch, joiners: see _fits), out of the queue and into the running set (lock held)."""
        picked: list[Job] = []
        for j in [j for j in self.waiting if j.group == group][: max(0, room)]:
            if not self._fits(base + picked, j, running):
                break  # first come, first served: the later ones wait behind it
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
                self._charged([])
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

    def _start(self, jobs: list[Job]):
        t0 = time.monotonic()
        for j in jobs:
            j.started_at = t0
        shared = {k: jobs[0].sampling[k] for k in BATCH_SETTINGS if k in jobs[0].sampling}  # equal in a group
        rows = [{k: v for k, v in j.sampling.items() if k not in shared} for j in jobs]
        return self.gen.start_batch([j.prompt for j in jobs], [j.max_tokens for j in jobs], [j.stop for j in jobs],
                                    seed=[j.seed for j in jobs], cancelled=lambda r: jobs[r].cancelled,
                                    row_sampling=rows, **shared)

    def _joiners(self, group, room: int, admitted: int, live: list[Job] | None) -> list[Job]:
        """Waiting jobs that may join the running batch now: of its group, only while no job of
        another group waits ahead of them (first come, first served), only up to
        MAX_ROWS_PER_BATCH rows admitted (then the batch drains and ends, freeing its finished rows),
        and only while the memory account has room for them (``live``: the batch's running jobs)."""
        with self.lock:
            if (room <= 0 or self.closed or not self.waiting or self.waiting[0].group != group
                    or admitted >= MAX_ROWS_PER_BATCH):
                return []
            return self._take(group, min(room, MAX_ROWS_PER_BATCH - admitted), [], live)

    def _run(self, first: list[Job]) -> None:
        """Step one batch until its last row ends, taking in compatible jobs between passes."""
        engine, jobs = self.gen.engine, list(first)  # jobs[r]: the job of the batch's row r
        counted = self.memory_budget is not None
        self._charged(jobs)
        batch = self._start(jobs)
        if self.held >= TRIM_AFTER:  # a large prefill's activations: back to the system, not kept by the allocator
            trim_heap()
        try:
            while not batch.done:
                live = [jobs[r] for r in batch.active] if counted else None
                joiners = self._joiners(first[0].group, self.max_batch_size - len(batch.active), len(jobs), live) \
                    if batch.accepts_rows else []
                if joiners:
                    try:
                        joined = self._start(joiners)
                    except Exception as e:  # only the joiners fail; the running rows go on
                        self._fail(_error_message(e, "joining requests failed"), joiners)
                    else:
                        engine.join(batch, joined)
                        jobs += joiners
                        if counted:  # the caches the join replaced go back (not kept for reuse)
                            self.gen.drop_idle()
                            self._charged([jobs[r] for r in batch.active], joiners)
                            if self.held >= TRIM_AFTER:  # the replaced caches' pages: a larger cache fits no hole
                                trim_heap()
                t0 = time.monotonic()
                for r, new in engine.step(batch):
                    jobs[r].sink(("tokens", new))
                self._paced(batch, time.monotonic() - t0)
                self._report(batch, jobs)
                if self.on_pass is not None and batch.active:
                    self.on_pass(len(batch.active))
        finally:
            engine.finish(batch)
        self._report(batch, jobs)

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
        if self.on_done is not None:
            self.on_done([jobs[r] for r in ended], outputs)

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
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..errors import SpeculantError

log = logging.getLogger("speculant.server")
BATCH_SETTINGS = ("gamma", "speculate")  # what a batch's rows share; the rest of Job.sampling is per row
MAX_ROWS_PER_BATCH = 1024  # rows one batch admits in its life: a batch keeps its finished rows until it ends


def _error_message(e: Exception, what: str) -> str:
    """What a client is told of a failure: our one-line errors as they are; anything else is an
    internal error, logged with its traceback."""
    if isinstance(e, SpeculantError):
        return str(e)
    log.exception(what)
    return "internal error while generating: the server's log has the details"


class QueueFull(SpeculantError):
    pass


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


class Scheduler:
    def __init__(self, generator, max_batch_size: int = 32, max_queue: int = 256, on_done=None, on_pass=None):
        if max_batch_size < 1 or max_queue < 1:
            raise SpeculantError("max_batch_size and max_queue must be >= 1")
        self.gen = generator
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.on_done = on_done  # callable(jobs, outputs): metrics of finished jobs
        self.on_pass = on_pass  # callable(rows): metrics of each pass's batch size
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.lock = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="speculant-engine", daemon=True)
        self.thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs, all or none (QueueFull when there is no room)."""
        with self.lock:
            if self.closed:
                raise SpeculantError("the server is shutting down")
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting): retry later")
            self.waiting.extend(jobs)
            self.lock.notify()

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
            return [first] + self._take(first.group, self.max_batch_size - 1)

    def _take(self, group, room: int) -> list[Job]:
        """Up to ``room`` waiting jobs of ``group``, out of the queue and into the running set (lock held)."""
        taken = [j for j in self.waiting if j.group == group][: max(0, room)]
        for j in taken:
            self.waiting.remove(j)
        self.running += taken
        return taken

    def _loop(self) -> None:
        while True:
            jobs = self._next_batch()
            if not jobs:
                return
            with self.lock:
                self.running = list(jobs)
            try:
                self._run(jobs)
            except Exception as e:  # keep serving: report it to this batch's clients (and the log)
                self._fail(_error_message(e, "batch failed"))
            finally:
                with self.lock:
                    self.running = []

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

    def _joiners(self, group, room: int, admitted: int) -> list[Job]:
        """Waiting jobs that may join the running batch now: of its group, only while no job of
        another group waits ahead of them (first come, first served), and only up to
        MAX_ROWS_PER_BATCH rows admitted (then the batch drains and ends, freeing its finished rows)."""
        with self.lock:
            if (room <= 0 or self.closed or not self.waiting or self.waiting[0].group != group
                    or admitted >= MAX_ROWS_PER_BATCH):
                return []
            return self._take(group, min(room, MAX_ROWS_PER_BATCH - admitted))

    def _run(self, first: list[Job]) -> None:
        """Step one batch until its last row ends, taking in compatible jobs between passes."""
        engine, jobs = self.gen.engine, list(first)  # jobs[r]: the job of the batch's row r
        batch = self._start(jobs)
        try:
            while not batch.done:
                joiners = self._joiners(first[0].group, self.max_batch_size - len(batch.active), len(jobs)) \
                    if batch.accepts_rows else []
                if joiners:
                    try:
                        joined = self._start(joiners)
                    except Exception as e:  # only the joiners fail; the running rows go on
                        self._fail(_error_message(e, "joining requests failed"), joiners)
                    else:
                        engine.join(batch, joined)
                        jobs += joiners
                for r, new in engine.step(batch):
                    jobs[r].sink(("tokens", new))
                self._report(batch, jobs)
                if self.on_pass is not None and batch.active:
                    self.on_pass(len(batch.active))
        finally:
            engine.finish(batch)
        self._report(batch, jobs)

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

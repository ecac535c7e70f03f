"""One owner thread runs the engine; requests wait in a queue and compatible ones share a batch.

Every request becomes one *job* per choice (``n`` choices: ``n`` jobs). The owner thread is the only
code that touches the Generator (its engine, KV caches and drafter state), so concurrent clients
never share mutable state. It takes the oldest waiting job and, up to ``max_batch_size``, the
waiting jobs of the same *group* (equal sampling settings; a seeded request only with its own
choices, so a seed gives the same text whatever else is waiting), and runs them as one batch.
Rows leave the batch as they finish (EOS, stop, length, cancel); jobs that arrive meanwhile wait
for the next batch (batching by waves: rows do not yet join a running batch).

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


class QueueFull(SpeculantError):
    pass


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sink: Callable[[tuple], None]
    stop: list[str] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # SamplingParams fields, logprobs, gamma
    seed: int | None = None
    group: object = None  # jobs with equal groups may share a batch
    cancelled: bool = False
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None


class Scheduler:
    def __init__(self, generator, max_batch_size: int = 32, max_queue: int = 256, on_batch=None):
        if max_batch_size < 1 or max_queue < 1:
            raise SpeculantError("max_batch_size and max_queue must be >= 1")
        self.gen = generator
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.on_batch = on_batch  # callable(jobs, outputs, seconds): metrics
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
            batch = [first] + [j for j in self.waiting if j.group == first.group]
            batch = batch[: self.max_batch_size]
            for j in batch[1:]:
                self.waiting.remove(j)
            self.running = batch
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch:
                return
            try:
                self._run(batch)
            except SpeculantError as e:
                for j in batch:
                    j.sink(("error", str(e)))
            except Exception as e:  # keep serving: report it to this batch's clients and the log
                log.exception("batch failed")
                for j in batch:
                    j.sink(("error", f"internal error: {type(e).__name__}: {e}"))
            finally:
                with self.lock:
                    self.running = []

    def _run(self, batch: list[Job]) -> None:
        t0 = time.monotonic()
        for j in batch:
            j.started_at = t0
        head = batch[0]
        it = self.gen.stream_batch([j.prompt for j in batch], [j.max_tokens for j in batch], [j.stop for j in batch],
                                   seed=head.seed, cancelled=lambda r: batch[r].cancelled, **head.sampling)
        while True:
            try:
                r, new = next(it)
            except StopIteration as done:
                rows = done.value
                break
            batch[r].sink(("tokens", new))
        outputs = self.gen.outputs(rows, [j.stop for j in batch])
        for j, out in zip(batch, outputs):
            j.sink(("done", out))
        if self.on_batch is not None:
            self.on_batch(batch, outputs, time.monotonic() - t0)

"""Prometheus metrics of the server (text format at GET /metrics), one registry per app."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, scheduler_depth=lambda: 0, running_rows=lambda: 0, memory_held=lambda: 0,
                 memory_budget=lambda: 0):
        r = self.registry = CollectorRegistry()
        self.totals = dict.fromkeys(("prompt", "generated", "drafted", "accepted", "passes", "speculative", "gamma"), 0)
        self.requests = Counter("speculant_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("speculant_prompt_tokens", "prompt tokens of finished choices", registry=r)
        self.generated_tokens = Counter("speculant_generated_tokens", "tokens generated", registry=r)
        self.draft_tokens = Counter("speculant_draft_tokens", "draft tokens verified by the target", registry=r)
        self.accepted_tokens = Counter("speculant_accepted_draft_tokens", "draft tokens the target accepted",
                                       registry=r)
        self.row_passes = Counter("speculant_target_row_passes",
                                  "target forward passes, counted per batch row (prefill included)", registry=r)
        self.speculative_passes = Counter("speculant_speculative_row_passes",
                                          "row passes that verified drafts (speculation on)", registry=r)
        self.gamma_sum = Counter("speculant_gamma_sum", "draft length allowed, summed over row passes "
                                 "(mean γ = rate of this / rate of row passes)", registry=r)
        self.acceptance = Gauge("speculant_acceptance_rate", "accepted / drafted tokens since start", registry=r)
        self.tau = Gauge("speculant_tokens_per_pass", "τ: tokens per target row pass since start", registry=r)
        self.speculation_share = Gauge("speculant_speculation_on_share",
                                       "share of row passes that speculated, since start", registry=r)
        self.mean_gamma = Gauge("speculant_mean_gamma", "mean γ chosen per row pass, since start", registry=r)
        self.queue = Gauge("speculant_queue_depth", "choices waiting for a batch", registry=r)
        self.queue.set_function(scheduler_depth)
        self.batch = Gauge("speculant_running_rows", "rows in the batch being decoded", registry=r)
        self.batch.set_function(running_rows)
        self.memory_held = Gauge("speculant_memory_held_bytes", "bytes the running batch is charged (caches, "
                                 "logits, buffers)", registry=r)
        self.memory_held.set_function(memory_held)
        self.memory_budget = Gauge("speculant_memory_budget_bytes", "bytes all requests together may hold "
                                   "(--max-memory)", registry=r)
        self.memory_budget.set_function(memory_budget)
        self.batch_sizes = Histogram("speculant_batch_size", "rows decoded together, per target pass", registry=r,
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.latency = Histogram("speculant_request_latency_seconds", "request arrival to last token",
                                 registry=r, buckets=LATENCY_BUCKETS)
        self.first_token = Histogram("speculant_time_to_first_token_seconds", "request arrival to first token",
                                     registry=r, buckets=LATENCY_BUCKETS)
        self.queue_wait = Histogram("speculant_queue_seconds", "arrival to the start of its batch", registry=r,
                                    buckets=LATENCY_BUCKETS)

    def record_pass(self, rows: int) -> None:
        """Called by the scheduler's owner thread after each pass."""
        self.batch_sizes.observe(rows)

    def record_done(self, jobs, outputs) -> None:
        """Called by the scheduler's owner thread as jobs finish."""
        t = self.totals
        for job, out in zip(jobs, outputs):
            s = out.stats
            counts = {"prompt": len(out.prompt_token_ids), "generated": s["new_tokens"],
                      "drafted": s["draft_tokens"], "accepted": s["accepted_draft_tokens"],
                      "passes": s["target_forward_passes"], "speculative": s["speculative_passes"],
                      "gamma": s["mean_gamma"] * max(0, s["target_forward_passes"] - 1)}
            for name, counter in (("prompt", self.prompt_tokens), ("generated", self.generated_tokens),
                                  ("drafted", self.draft_tokens), ("accepted", self.accepted_tokens),
                                  ("passes", self.row_passes), ("speculative", self.speculative_passes),
                                  ("gamma", self.gamma_sum)):
                counter.inc(counts[name])
                t[name] += counts[name]
            if job.started_at is not None:
                self.queue_wait.observe(job.started_at - job.queued_at)
        passes = max(1, t["passes"])
        self.acceptance.set(t["accepted"] / t["drafted"] if t["drafted"] else 0.0)
        self.tau.set(t["generated"] / passes)
        self.speculation_share.set(t["speculative"] / passes)
        self.mean_gamma.set(t["gamma"] / passes)

    def text(self) -> bytes:
        return generate_latest(self.registry)

"""Hostile requests beside ordinary traffic on ``speculant serve``: does anything a request sends
hold the engine, the GIL or the queue?

    python -m speculant.bench.hostile_load --out benchmarks/results/NAME

Starts the server in this process on a loopback port (API key on), measures an ordinary request's
latency and ``/health``'s unloaded, then runs each hostile case while ordinary requests (one at a
time) and ``/health`` probes (every 50 ms) go on beside it, and records what the hostile request
got (status, message, seconds), the ordinary requests' latency against the unloaded one and
``/health``'s slowest answer. Every request is bounded (a client timeout). Writes hostile_load.json
(with the machine) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from ..server.background import BackgroundServer
from ..tools.loader import load
from .machine import machine_info, what_ran
from .serve_load import run_and_write

KEY = "hostile-load"
ORDINARY = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
CLIENT_TIMEOUT = 120.0


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _recursive_schema() -> dict:
    branches = [{"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
                 "description": f"v{i}"} for i in range(16)]
    return {"$defs": {"n": {"anyOf": branches}}, "$ref": "#/$defs/n"}


def cases(long_prompt: str) -> dict[str, list[tuple[str, dict]]]:
    """Each case: the (path, body) requests it sends at once."""
    completions = "/v1/completions"
    slow_pattern = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|b|c){0,3000}$"}},
                    "required": ["s"]}
    slow_root = {"type": "string", "pattern": "^(a|b|c|d){0,4000}$"}
    return {
        "recursive anyOf schema": [(completions, {"prompt": "Answer in JSON:", "max_tokens": 40, "temperature": 0,
                                                  "response_format": _schema_format(_recursive_schema())})],
        "slow pattern in a property": [(completions, {"prompt": "JSON:", "max_tokens": 16, "temperature": 0,
                                                      "response_format": _schema_format(slow_pattern)})],
        "16 slow root patterns at once": [(completions, {"prompt": "JSON:", "max_tokens": 8, "temperature": 0,
                                                         "response_format": _schema_format(slow_root)})] * 16,
        "long prompt": [(completions, {"prompt": long_prompt, "max_tokens": 4, "temperature": 0})],
        "json_object chat, no max_tokens": [("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "List every country you know as JSON."}], "temperature": 0,
            "response_format": {"type": "json_object"}})],
        "lone surrogate model": [(completions, {"model": "\ud800", "prompt": "hi", "max_tokens": 4})],
    }


def _post(client, path: str, body: dict) -> tuple[int, str, float]:
    t = time.perf_counter()
    try:
        r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        said = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
        return r.status_code, said[:200], time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 -- recorded, as a client sees it
        return 0, f"{type(e).__name__}: {e}"[:200], time.perf_counter() - t


def _ordinary(client, n: int) -> list[float]:
    return [_post(client, "/v1/completions", {**ORDINARY, "model": "bench"})[2] for _ in range(n)]


def _probe(client, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        try:
            client.get("/health", timeout=CLIENT_TIMEOUT)
        except Exception:  # noqa: BLE001 -- a timeout counts as its full wait
            pass
        out.append(time.perf_counter() - t)
        stop.wait(0.05)


def run_case(url: str, requests: list[tuple[str, dict]]) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    results: list = [None] * len(requests)

    def send(i: int, path: str, body: dict) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=CLIENT_TIMEOUT) as c:
            results[i] = _post(c, path, {"model": "bench", **body})

    stop, health = threading.Event(), []
    with httpx.Client(base_url=url, headers=headers, timeout=CLIENT_TIMEOUT) as c:
        prober = threading.Thread(target=_probe, args=(c, stop, health), daemon=True)
        prober.start()
        senders = [threading.Thread(target=send, args=(i, p, b), daemon=True) for i, (p, b) in enumerate(requests)]
        for s in senders:
            s.start()
        time.sleep(0.2)  # the hostile requests first
        ordinary = []
        while any(s.is_alive() for s in senders) or len(ordinary) < 3:
            ordinary += _ordinary(c, 1)
        for s in senders:
            s.join()
        stop.set()
        prober.join()
    statuses = sorted({r[0] for r in results})
    return {"statuses": statuses, "message": next((r[1] for r in results if r[1]), ""),
            "hostile_seconds_max": round(max(r[2] for r in results), 3),
            "ordinary_requests": len(ordinary), "ordinary_seconds_max": round(max(ordinary), 3),
            "ordinary_seconds_median": round(statistics.median(ordinary), 3),
            "ordinary_seconds_p95": round(statistics.quantiles(ordinary, n=20, method="inclusive")[-1], 3) if len(ordinary) > 1 else None,
            "ordinary_seconds": [round(x, 3) for x in ordinary],
            "health_seconds_max": round(max(health), 4) if health else None, "health_probes": len(health)}


def run(args) -> dict:
    import httpx

    from ..server.app import create_app  # the serve extra (fastapi), installed apart

    gen = load(args.target, drafter=args.drafter, dtype=args.dtype)
    app = create_app(gen, "bench", api_key=KEY, request_timeout=args.request_timeout)
    served = BackgroundServer(app, args.port)
    long_prompt = " ".join(f"word{i}" for i in range(args.long_prompt_words))
    rows = {}
    try:
        with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=CLIENT_TIMEOUT) as c:
            _ordinary(c, 2)  # warm-up
            unloaded = _ordinary(c, 5)
            health = []
            for _ in range(20):
                t = time.perf_counter()
                c.get("/health")
                health.append(time.perf_counter() - t)
        base = {"ordinary_seconds_median": round(statistics.median(unloaded), 3),
                "health_seconds_max": round(max(health), 4)}
        print(f"unloaded: an ordinary request {base['ordinary_seconds_median']:.3f} s, /health at most "
              f"{base['health_seconds_max'] * 1000:.1f} ms", flush=True)
        for name, requests in cases(long_prompt).items():
            if args.only and name not in args.only:
                continue
            row = run_case(served.url, requests)
            row["ordinary_vs_unloaded"] = round(row["ordinary_seconds_max"] / base["ordinary_seconds_median"], 2)
            rows[name] = row
            print(f"{name:34s} -> {row['statuses']} in {row['hostile_seconds_max']:6.2f} s; ordinary at most "
                  f"{row['ordinary_seconds_max']:.2f} s ({row['ordinary_vs_unloaded']:.1f}x); /health at most "
                  f"{row['health_seconds_max'] * 1000:.0f} ms; {row['message'][:90]}", flush=True)
    finally:
        served.close()
    return {"target": args.target, "machine": machine_info(gen.target.device), "ran": what_ran(gen),
            "unloaded": base, "cases": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculant.bench.hostile_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--long-prompt-words", type=int, default=1500, help="the long prompt's length in words")
    p.add_argument("--only", nargs="*", default=None, help="run only these cases (by name)")
    p.add_argument("--port", type=int, default=8767)
    p.add_argument("--out", default=None, help="folder for hostile_load.json")
    return run_and_write("hostile_load", run, p.parse_args(argv), "hostile_load.json")


if __name__ == "__main__":
    sys.exit(main())

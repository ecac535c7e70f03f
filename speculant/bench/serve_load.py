"""Load on ``speculant serve``: throughput and latency with and without speculation, side by side.

    python -m speculant.bench.serve_load --target default --drafter suffix --concurrency 1,64 \\
        --requests 64 --max-tokens 64 --out benchmarks/results/NAME

Starts the server in this process on a loopback port, then for each concurrency level sends the
bench's prompts (chat, greedy) with the OpenAI client, once with speculation and once with
``speculate: false`` (plain decoding through the same engine), and reports requests/s, generated
tokens/s, p50/p99 latency and time to first token. Writes serve_load.json (with the machine and
what ran: ``bench/machine.py``) and prints a table.
With ``--warmup-waves N``, N unmeasured speculative waves at each level come first: the γ
controller measures what passes cost at a new batch size once per engine, so the measured waves
show a server that has run a while (the first wave pays for that measuring).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from ..errors import SpeculantError, check_writable
from ..server.background import BackgroundServer
from ..tools.loader import load
from .prompts import read_prompts
from .machine import machine_info, what_ran


def _quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)


async def _level(url: str, model: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int,
                 speculate: bool, chat: bool = True) -> dict:
    import openai  # a test extra: only this load test's client uses it

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    gate, latency, first, tokens, failures = asyncio.Semaphore(concurrency), [], [], [0], []

    async def one(i: int):
        async with gate:
            t = time.perf_counter()
            try:
                ask = dict(model=model, temperature=0, max_tokens=max_tokens, stream=True,
                           stream_options={"include_usage": True}, extra_body={"speculate": speculate})
                text = prompts[i % len(prompts)]
                if chat:
                    stream = await client.chat.completions.create(messages=[{"role": "user", "content": text}], **ask)
                else:
                    stream = await client.completions.create(prompt=text, **ask)
                seen = False
                async for chunk in stream:
                    piece = (chunk.choices[0].delta.content if chat else chunk.choices[0].text) if chunk.choices else ""
                    if not seen and piece:
                        first.append(time.perf_counter() - t)
                        seen = True
                    if chunk.usage:
                        tokens[0] += chunk.usage.completion_tokens
            except openai.OpenAIError as e:
                failures.append(f"{type(e).__name__}: {e}")
                return
            latency.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(requests)])
    secs = time.perf_counter() - t0
    await client.close()
    return {"speculate": speculate, "concurrency": concurrency, "requests": requests, "failures": len(failures),
            "failure_examples": failures[:3], "seconds": round(secs, 2),
            "requests_per_second": round(requests / secs, 3), "tokens_per_second": round(tokens[0] / secs, 2),
            "p50_latency_s": round(_quantile(latency, 50), 3), "p99_latency_s": round(_quantile(latency, 99), 3),
            "p50_first_token_s": round(_quantile(first, 50), 3), "generated_tokens": tokens[0]}


def run(args) -> dict:
    from ..server.app import create_app  # the serve extra (fastapi), installed apart

    prompts = [p.prompt for p in read_prompts(args.prompts)]
    gen = load(args.target, drafter=args.drafter, dtype=args.dtype, device=args.device)
    batch = max(args.concurrency)
    app = create_app(gen, "bench", max_batch_size=batch, max_queue=max(256, 2 * args.requests))
    served = BackgroundServer(app, args.port)
    url = served.url
    chat = bool(getattr(gen.tokenizer, "chat_template", None))  # else raw-text completions
    rows = []
    try:
        asyncio.run(_level(url, "bench", prompts, 2, 1, 8, True, chat))  # warm-up
        for c in args.concurrency:
            for _ in range(args.warmup_waves):
                asyncio.run(_level(url, "bench", prompts, c, c, args.max_tokens, True, chat))
            for speculate in (False, True):
                n = args.requests if c > 1 else max(1, min(args.requests, args.batch1_requests))
                row = asyncio.run(_level(url, "bench", prompts, n, c, args.max_tokens, speculate, chat))
                rows.append(row)
                print(f"concurrency {c:3d} {'speculative' if speculate else 'plain      '}: "
                      f"{row['requests_per_second']:7.2f} req/s {row['tokens_per_second']:8.1f} tok/s  "
                      f"p50 {row['p50_latency_s']:7.2f} s  p99 {row['p99_latency_s']:7.2f} s  "
                      f"first token p50 {row['p50_first_token_s']:.2f} s  failures {row['failures']}"
                      + (f" ({row['failure_examples'][0]})" if row["failures"] else ""), flush=True)
    finally:
        served.close()
    stats = app.state.speculant["metrics"].totals
    return {"target": args.target, "machine": machine_info(gen.target.device), "ran": what_ran(gen),
            "max_tokens": args.max_tokens, "endpoint": "chat" if chat else "completions",
            "warmup_waves": args.warmup_waves, "server_totals": stats, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculant.bench.serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--prompts", default=None, help="a bench prompt file (default: the built-in suite)")
    p.add_argument("--concurrency", default="1,64", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=64, help="requests per level (concurrency > 1)")
    p.add_argument("--batch1-requests", type=int, default=8, help="requests at concurrency 1")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup-waves", type=int, default=0,
                   help="unmeasured speculative waves of `concurrency` requests before each level")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out", default=None, help="folder for serve_load.json")
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if (not args.concurrency or min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1
                or args.warmup_waves < 0):
            raise ValueError
    except ValueError:
        print("serve_load: error: --concurrency must be integers >= 1; --requests and --max-tokens >= 1; "
              "--warmup-waves >= 0",
              file=sys.stderr)
        return 2
    return run_and_write("serve_load", run, args, "serve_load.json")


def run_and_write(prog: str, run, args, name: str) -> int:
    """``run(args)``, its result written as ``name`` in the folder ``args.out`` (checked before the
    run's minutes, not when it is written); a SpeculantError one line. The exit status."""
    try:
        if args.out:
            check_writable(args.out)
        result = run(args)
    except SpeculantError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

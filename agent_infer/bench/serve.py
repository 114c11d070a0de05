"""`agent-infer bench serve`: a load generator for any OpenAI-compatible endpoint.

Requests stream (SSE) so that time to first token (TTFT) and the gaps between chunks
(ITL) are measured on the client, as a user sees them. Arrivals follow a Poisson
process at `--request-rate` (inf: all at once), optionally capped at
`--max-concurrency` requests in flight.

Random prompts: for the completions endpoint they are random token ids, so the input
length is exact without a tokenizer on the client (vLLM and SGLang accept token-id
prompts too); for chat they are random words (about one token each), or exact-length
text when `--tokenizer` is given. `ignore_eos` is sent so that output lengths are
exact. Token counts come from the server's usage report (`stream_options.include_usage`).

Reported: request / output / total token throughput, and TTFT, TPOT (time per output
token after the first), ITL and end-to-end latency as mean, median and p99.

The client is aiohttp, as in vLLM's benchmark: at 64 streams of ~165 chunks/s each,
httpx spent three times the CPU per chunk and its one event loop became the bottleneck,
so the benchmark measured the client (docs/PERFORMANCE.md, tried and rejected).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

# Common English words; each is one token (with its leading space) in most BPE vocabularies.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which are be had not or have "
    "one all were their there been has when who will more no if out so said what up its about into than them "
    "can only other new some could time these two may then do first any my now such like our over man me even "
    "most made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three"
).split()


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "completions"  # completions | chat
    num_prompts: int = 100
    request_rate: float = math.inf  # requests per second (Poisson); inf = all at once
    max_concurrency: int | None = None
    random_input_len: int = 128
    random_output_len: int = 128
    random_vocab_low: int = 100  # token ids of random prompts are drawn from [low, high)
    random_vocab_high: int = 10000
    dataset_path: str | None = None  # one prompt per line, or JSONL {"prompt": ..., "max_tokens": ...}
    tokenizer: str | None = None  # HF tokenizer dir: exact-length text prompts for chat
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("random input and output lengths must be >= 1")


@dataclass(frozen=True)
class PromptSpec:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---- prompts ------------------------------------------------------------------------


def make_prompts(cfg: BenchConfig) -> list[PromptSpec]:
    rng = random.Random(cfg.seed)
    if cfg.dataset_path:
        return _file_prompts(cfg, rng)
    if cfg.endpoint == "completions" and cfg.tokenizer is None:
        return [PromptSpec([rng.randrange(cfg.random_vocab_low, cfg.random_vocab_high)
                            for _ in range(cfg.random_input_len)], cfg.random_output_len)
                for _ in range(cfg.num_prompts)]
    tokenizer = _load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    return [PromptSpec(_random_text(rng, cfg.random_input_len, tokenizer), cfg.random_output_len)
            for _ in range(cfg.num_prompts)]


def _random_text(rng: random.Random, num_tokens: int, tokenizer) -> str:
    words = [rng.choice(_WORDS) for _ in range(num_tokens)]
    if tokenizer is None:
        return " ".join(words)
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    while len(ids) < num_tokens:  # a few words may merge: top up
        ids += tokenizer.encode(" " + rng.choice(_WORDS), add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _file_prompts(cfg: BenchConfig, rng: random.Random) -> list[PromptSpec]:
    specs = []
    with open(cfg.dataset_path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if cfg.dataset_path.endswith(".jsonl"):
                obj = json.loads(line)
                specs.append(PromptSpec(obj["prompt"], int(obj.get("max_tokens", cfg.random_output_len))))
            else:
                specs.append(PromptSpec(line.replace("\\n", "\n"), cfg.random_output_len))
    if not specs:
        raise ValueError(f"no prompts in {cfg.dataset_path}")
    rng.shuffle(specs)
    return [specs[i % len(specs)] for i in range(cfg.num_prompts)]


# ---- one request --------------------------------------------------------------------


def _body(cfg: BenchConfig, model: str, spec: PromptSpec) -> dict:
    body = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


async def run_request(session: aiohttp.ClientSession, cfg: BenchConfig, model: str, spec: PromptSpec) -> RequestResult:
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    result = RequestResult()
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with session.post(_url(cfg, path), json=_body(cfg, model, spec)) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status}: {text[:200]}"
                return result
            async for raw in resp.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"].get("message", obj["error"]))
                    return result
                if obj.get("usage"):
                    result.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    result.output_tokens = obj["usage"].get("completion_tokens", 0)
                if _chunk_text(obj, cfg.endpoint):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    if last is None:
        result.error = "no tokens received"
        return result
    if result.output_tokens == 0:  # the server sent no usage: count chunks
        result.output_tokens = chunks
    result.ok = True
    return result


def _url(cfg: BenchConfig, path: str) -> str:
    return cfg.base_url.rstrip("/") + path


def _chunk_text(obj: dict, endpoint: str) -> str:
    text = ""
    for choice in obj.get("choices") or []:
        if endpoint == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


# ---- the run ------------------------------------------------------------------------


async def run_benchmark(cfg: BenchConfig, prompts: list[PromptSpec] | None = None) -> dict:
    prompts = prompts if prompts is not None else make_prompts(cfg)
    limit = cfg.max_concurrency or len(prompts)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    connector = aiohttp.TCPConnector(limit=limit)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = cfg.model or await _first_model(session, cfg)
        gate = asyncio.Semaphore(limit)
        rng = random.Random(cfg.seed + 1)

        async def gated(spec: PromptSpec) -> RequestResult:
            async with gate:
                return await run_request(session, cfg, model, spec)

        start = time.perf_counter()
        tasks = []
        for i, spec in enumerate(prompts):
            tasks.append(asyncio.create_task(gated(spec)))
            if math.isfinite(cfg.request_rate) and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(cfg, model, results, duration)


async def _first_model(session: aiohttp.ClientSession, cfg: BenchConfig) -> str:
    async with session.get(_url(cfg, "/models")) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    """mean / median / p99 / std (milliseconds by default); zeros when empty."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0, "std": 0.0}
    xs = sorted(v * scale for v in values)
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p99": _percentile(xs, 99.0),
            "std": statistics.pstdev(xs)}


def _percentile(sorted_xs: list[float], q: float) -> float:
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(cfg: BenchConfig, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    config = asdict(cfg)
    config["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    config.pop("api_key", None)
    return {
        "config": config,
        "model": model,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.e2e for r in ok]),
        "per_request": {
            "prompt_tokens": [r.prompt_tokens for r in ok],
            "output_tokens": [r.output_tokens for r in ok],
            "ttft_s": [r.ttft for r in ok],
            "e2el_s": [r.e2e for r in ok],
        },
    }


def format_report(res: dict) -> str:
    lines = [
        f"{'Model:':<34}{res['model']}",
        f"{'Successful requests:':<34}{res['completed']}",
        f"{'Failed requests:':<34}{res['failed']}",
        f"{'Benchmark duration (s):':<34}{res['duration_s']:.2f}",
        f"{'Total input tokens:':<34}{res['total_input_tokens']}",
        f"{'Total generated tokens:':<34}{res['total_output_tokens']}",
        f"{'Request throughput (req/s):':<34}{res['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<34}{res['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<34}{res['total_token_throughput']:.2f}",
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        s = res[key]
        lines.append(f"{name + ' (ms):':<34}mean {s['mean']:.2f}  median {s['median']:.2f}  p99 {s['p99']:.2f}")
    for err, count in res["errors"].items():
        lines.append(f"error x{count}: {err}")
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` under the `bench` command."""
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="API root, e.g. http://host:8000/v1")
    p.add_argument("--model", default=None, help="model name to send (default: the first one the server lists)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, Poisson (default inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128,
                   help="max_tokens of each request (also for prompts from --dataset-path without their own)")
    p.add_argument("--random-vocab-low", type=int, default=100)
    p.add_argument("--random-vocab-high", type=int, default=10000)
    p.add_argument("--dataset-path", default=None, help="prompts: one per line, or JSONL with prompt / max_tokens")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory for exact-length random text prompts")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for endpoints that reject it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--api-key", default=None)
    p.add_argument("--result-json", default=None, help="write the results as JSON to this path")
    p.set_defaults(handler=cmd_bench_serve)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, num_prompts=args.num_prompts,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_vocab_low=args.random_vocab_low, random_vocab_high=args.random_vocab_high,
        dataset_path=args.dataset_path, tokenizer=args.tokenizer, ignore_eos=args.ignore_eos,
        temperature=args.temperature, seed=args.seed, timeout_s=args.timeout, api_key=args.api_key,
    )


def cmd_bench_serve(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    res = asyncio.run(run_benchmark(cfg))
    print(format_report(res))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {args.result_json}", file=sys.stderr)
    return 0 if res["completed"] > 0 else 1

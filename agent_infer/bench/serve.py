"""`agent-infer bench serve`: a load generator for any OpenAI-compatible endpoint.

Requests stream (SSE) so that time to first token (TTFT) and the gaps between chunks
(ITL) are measured on the client, as a user sees them. Arrivals follow a Poisson
process at `--request-rate` (inf: all at once), optionally capped at
`--max-concurrency` requests in flight. `--no-stream` sends plain requests (one JSON
response each): then only the end-to-end latency is measured, and TTFT, TPOT and ITL are
reported as null.

Prompts:
- random (the default): for the completions endpoint random token ids, so the input
  length is exact without a tokenizer on the client (vLLM and SGLang accept token-id
  prompts too); for chat random words (about one token each), or exact-length text when
  `--tokenizer` is given;
- `--workload nano-vllm`: the very requests `bench throughput --workload nano-vllm`
  runs offline (the same function, agent_infer.bench.workloads, and the same `--seed`):
  token-id prompts and per-request max_tokens, so the two can be compared request for
  request. The draw depends on the vocabulary only through min(10000, vocab - 1): any
  vocabulary above 10,000 tokens draws the same ids (`--vocab-size`, default Qwen3's);
- `--dataset-path`: one prompt per line, or JSONL with prompt / max_tokens.
`ignore_eos` is sent so that output lengths are exact. Token counts come from the server's
usage report (`stream_options.include_usage` when streaming).

Reported: request / output / total token throughput, TTFT, TPOT (time per output token
after the first), ITL and end-to-end latency as mean, median and p99, and the client's
own CPU time over the run (all its threads) as seconds and as a share of the wall time:
near 1.0 means the load generator, not the server, set the pace.

The client is aiohttp, as in vLLM's benchmark: at 64 streams of ~165 chunks/s each,
httpx spent three times the CPU per chunk and its one event loop became the bottleneck,
so the benchmark measured the client (docs/PERFORMANCE.md, tried and rejected). For the
same reason the per-chunk work is kept small: streams are read as whatever bytes have
arrived (one await per read, not two per event), chunks are parsed by msgspec when it is
installed, and the command runs on uvloop's event loop when that is installed.
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

from agent_infer.bench.workloads import nano_vllm_workload, redraw_ids

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

WORKLOAD_CHOICES = ("random", "nano-vllm")
QWEN3_VOCAB_SIZE = 151936


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "completions"  # completions | chat
    workload: str = "random"  # random (or --dataset-path) | nano-vllm
    num_prompts: int = 100
    request_rate: float = math.inf  # requests per second (Poisson); inf = all at once
    max_concurrency: int | None = None
    random_input_len: int = 128
    random_output_len: int = 128
    random_vocab_low: int = 100  # token ids of random prompts are drawn from [low, high)
    random_vocab_high: int = 10000
    min_len: int = 100  # nano-vllm: input and output lengths uniform in [min_len, max_len]
    max_len: int = 1024
    vocab_size: int = QWEN3_VOCAB_SIZE  # nano-vllm: ids are drawn below min(10000, vocab_size - 1) + 1
    dataset_path: str | None = None  # one prompt per line, or JSONL {"prompt": ..., "max_tokens": ...}
    tokenizer: str | None = None  # HF tokenizer dir: exact-length text prompts for chat
    ignore_eos: bool = True
    stream: bool = True
    temperature: float = 0.0
    seed: int = 0
    seed_per_request: bool = False  # request i samples with seed + i, as `bench throughput` seeds them
    redraw_ids: int | None = None  # nano-vllm: the draw's lengths, new ids from this seed (a fresh prefix cache)
    timeout_s: float = 600.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if self.workload not in WORKLOAD_CHOICES:
            raise ValueError(f"workload must be one of {', '.join(WORKLOAD_CHOICES)}, got {self.workload!r}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("random input and output lengths must be >= 1")
        if self.workload == "nano-vllm":
            self._check_nano_vllm()

    def _check_nano_vllm(self) -> None:
        if self.endpoint != "completions":
            raise ValueError("the nano-vllm workload's prompts are token ids: use the completions endpoint")
        if self.dataset_path:
            raise ValueError("give either the nano-vllm workload or a dataset path, not both")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError("need 1 <= min_len <= max_len")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")


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
    ttft: float | None = 0.0  # seconds; None when not streamed (not measurable)
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---- prompts ------------------------------------------------------------------------


def make_prompts(cfg: BenchConfig) -> list[PromptSpec]:
    rng = random.Random(cfg.seed)
    if cfg.workload == "nano-vllm":
        return workload_prompts(cfg)
    if cfg.dataset_path:
        return _file_prompts(cfg, rng)
    if cfg.endpoint == "completions" and cfg.tokenizer is None:
        return [PromptSpec([rng.randrange(cfg.random_vocab_low, cfg.random_vocab_high)
                            for _ in range(cfg.random_input_len)], cfg.random_output_len)
                for _ in range(cfg.num_prompts)]
    tokenizer = _load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    return [PromptSpec(_random_text(rng, cfg.random_input_len, tokenizer), cfg.random_output_len)
            for _ in range(cfg.num_prompts)]


def workload_prompts(cfg: BenchConfig) -> list[PromptSpec]:
    """nano-vllm's draw, as `bench throughput --workload nano-vllm --num-seqs N --seed S`
    makes it: the same token ids and max_tokens, in the same order."""
    prompts, out_lens = nano_vllm_workload(cfg.num_prompts, cfg.min_len, cfg.max_len, cfg.vocab_size, cfg.seed)
    if cfg.redraw_ids is not None:
        prompts = redraw_ids(prompts, cfg.vocab_size, cfg.redraw_ids)
    return [PromptSpec(p, n) for p, n in zip(prompts, out_lens)]


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


def _json_decoder():
    """msgspec's JSON decoder when it is installed (several times cheaper than json.loads,
    and the client parses every chunk of every stream), else json.loads. Both raise a
    ValueError on bad input."""
    try:
        import msgspec
    except ImportError:
        return json.loads
    return msgspec.json.Decoder().decode


_decode_json = _json_decoder()


def _body(cfg: BenchConfig, model: str, spec: PromptSpec, index: int = 0) -> dict:
    body = {"model": model, "max_tokens": spec.max_tokens, "temperature": cfg.temperature}
    if cfg.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.seed_per_request:
        body["seed"] = cfg.seed + index
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


async def run_request(session: aiohttp.ClientSession, cfg: BenchConfig, model: str, spec: PromptSpec,
                      index: int = 0) -> RequestResult:
    """One request, streamed or not as `cfg.stream` says; `index` is the prompt's position
    (its seed with --seed-per-request)."""
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with session.post(_url(cfg, path), json=_body(cfg, model, spec, index)) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status}: {text[:200]}"
                return result
            if cfg.stream:
                await _read_stream(resp, cfg.endpoint, result, start)
            else:
                await _read_response(resp, result)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: bad JSON or UTF-8
        result.error = f"{type(e).__name__}: {e}"
        return result
    if not result.error:
        result.e2e = time.perf_counter() - start
        result.ok = True
    return result


async def _read_response(resp: aiohttp.ClientResponse, result: RequestResult) -> None:
    """A plain (not streamed) response: the counts from its usage; no TTFT can be seen."""
    obj = _decode_json(await resp.read())
    result.ttft = None
    usage = obj.get("usage") or {}
    if "completion_tokens" not in usage:
        result.error = "the response has no usage: its token counts are unknown"
        return
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.output_tokens = usage["completion_tokens"]


async def _read_stream(resp: aiohttp.ClientResponse, endpoint: str, result: RequestResult, start: float) -> None:
    """An SSE stream, read as the bytes arrive: every event in one read gets that read's
    time, which is when the client could first have seen it."""
    pending = b""
    last = None
    chunks = 0
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        lines = (pending + data).split(b"\n")
        pending = lines.pop()  # an unfinished line waits for the next read
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                _end_stream(result, last, chunks)
                return
            obj = _decode_json(payload)
            if "error" in obj:
                result.error = _error_text(obj["error"])
                return
            if obj.get("usage"):
                result.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                result.output_tokens = obj["usage"].get("completion_tokens", 0)
            if _has_content(obj, endpoint):
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    _end_stream(result, last, chunks)


def _end_stream(result: RequestResult, last: float | None, chunks: int) -> None:
    if last is None:
        result.error = "no tokens received"
    elif result.output_tokens == 0:  # the server sent no usage: count chunks
        result.output_tokens = chunks


def _error_text(err) -> str:
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def _url(cfg: BenchConfig, path: str) -> str:
    return cfg.base_url.rstrip("/") + path


def _has_content(obj: dict, endpoint: str) -> bool:
    """Whether a chunk carries output: text, or token ids (a server without a tokenizer
    streams ids only)."""
    for choice in obj.get("choices") or []:
        if choice.get("token_ids"):
            return True
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                return True
        elif choice.get("text"):
            return True
    return False


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

        async def gated(index: int, spec: PromptSpec) -> RequestResult:
            async with gate:
                return await run_request(session, cfg, model, spec, index)

        cpu0 = time.process_time()
        start = time.perf_counter()
        tasks = []
        for i, spec in enumerate(prompts):
            tasks.append(asyncio.create_task(gated(i, spec)))
            if math.isfinite(cfg.request_rate) and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu_s = time.process_time() - cpu0
    res = summarize(cfg, model, results, duration, client_cpu_s=cpu_s)
    res["client_event_loop"] = type(asyncio.get_running_loop()).__module__.split(".")[0]  # uvloop | asyncio
    return res


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


def summarize(cfg: BenchConfig, model: str, results: list[RequestResult], duration: float,
              client_cpu_s: float | None = None) -> dict:
    """The run's figures. Not streamed: TTFT, TPOT and ITL are None (not measurable), not
    zeros. The client's CPU seconds over the run (all its threads) and their share of the
    wall time tell whether the load generator kept up."""
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
    streamed = cfg.stream

    def rate(n: float) -> float:
        return n / duration if duration > 0 else 0.0

    return {
        "config": config,
        "model": model,
        "streamed": streamed,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "ttft_ms": _stats([r.ttft for r in ok]) if streamed else None,
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]) if streamed else None,
        "itl_ms": _stats([x for r in ok for x in r.itl]) if streamed else None,
        "e2el_ms": _stats([r.e2e for r in ok]),
        "client_cpu_s": client_cpu_s,
        "client_cpu_fraction": client_cpu_s / duration if client_cpu_s is not None and duration > 0 else None,
        "client_event_loop": None,  # set by run_benchmark
        "per_request": {
            "prompt_tokens": [r.prompt_tokens for r in ok],
            "output_tokens": [r.output_tokens for r in ok],
            "ttft_s": [r.ttft for r in ok] if streamed else None,
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
        if s is None:
            lines.append(f"{name + ' (ms):':<34}not measured (not streamed)")
            continue
        lines.append(f"{name + ' (ms):':<34}mean {s['mean']:.2f}  median {s['median']:.2f}  p99 {s['p99']:.2f}")
    if res.get("client_cpu_s") is not None:
        loop = f", {res['client_event_loop']} event loop" if res.get("client_event_loop") else ""
        lines.append(f"{'Client CPU (s, share of wall):':<34}{res['client_cpu_s']:.2f} "
                     f"({res['client_cpu_fraction']:.2f}{loop})")
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
    p.add_argument("--workload", default="random", choices=WORKLOAD_CHOICES,
                   help="random: --random-* (or --dataset-path) prompts; nano-vllm: the requests `bench throughput "
                        "--workload nano-vllm` runs (same draw, same --seed, --min-len, --max-len; --num-prompts "
                        "is its --num-seqs), as token ids to the completions endpoint")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, Poisson (default inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128,
                   help="max_tokens of each request (also for prompts from --dataset-path without their own)")
    p.add_argument("--random-vocab-low", type=int, default=100)
    p.add_argument("--random-vocab-high", type=int, default=10000)
    p.add_argument("--min-len", type=int, default=100, help="nano-vllm: input and output lengths uniform in [min, max]")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB_SIZE,
                   help="nano-vllm: the model's vocabulary size (default Qwen3's, 151936); ids are drawn below "
                        "min(10000, vocab - 1) + 1, so any vocabulary above 10,000 tokens gives the same prompts")
    p.add_argument("--dataset-path", default=None, help="prompts: one per line, or JSONL with prompt / max_tokens")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory for exact-length random text prompts")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for endpoints that reject it)")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="plain requests, one JSON response each: end-to-end latency only (TTFT, TPOT, ITL null)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (bench throughput's default is 0.6: send the same to compare)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts (and, with --seed-per-request, the sampling)")
    p.add_argument("--seed-per-request", action="store_true",
                   help="send request i the sampling seed --seed + i, as bench throughput seeds its requests "
                        "(with the engine's --seed)")
    p.add_argument("--redraw-ids", type=int, default=None, metavar="SEED",
                   help="nano-vllm: keep the draw's lengths and max_tokens, draw new token ids with this seed, so "
                        "that a server which ran the workload before serves nothing from its prefix cache")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--api-key", default=None)
    p.add_argument("--result-json", default=None, help="write the results as JSON to this path")
    p.set_defaults(handler=cmd_bench_serve)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, workload=args.workload,
        num_prompts=args.num_prompts, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_vocab_low=args.random_vocab_low, random_vocab_high=args.random_vocab_high,
        min_len=args.min_len, max_len=args.max_len, vocab_size=args.vocab_size,
        dataset_path=args.dataset_path, tokenizer=args.tokenizer, ignore_eos=args.ignore_eos, stream=args.stream,
        temperature=args.temperature, seed=args.seed, seed_per_request=args.seed_per_request,
        redraw_ids=args.redraw_ids, timeout_s=args.timeout, api_key=args.api_key,
    )


def run(coro):
    """Run the benchmark's coroutine on uvloop's event loop when it is installed (less of
    the client's CPU per chunk), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"agent-infer bench serve: error: {e}", file=sys.stderr)
        return 2
    res = run(run_benchmark(cfg))
    print(format_report(res))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {args.result_json}", file=sys.stderr)
    return 0 if res["completed"] > 0 else 1

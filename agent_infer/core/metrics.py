"""Prometheus metrics of the server, kept by the engine core, so that every front end
serves the same totals (a front end's /metrics asks the core for this text).

Two sources:
* the engine's own counters and gauges (requests running/waiting, KV blocks, prefix-
  cache lookups, tokens) are read from the engine at scrape time, so they cannot drift
  from it;
* latencies, batch sizes and request outcomes are observed as they happen: the core's
  loop calls the `on_*` methods, and front ends report the HTTP errors they send.

The metrics live in a registry of their own (never the process-global default one, so
that several cores in one test process do not collide).

Every metric that vLLM also has is exported a second time under vLLM's name (`VLLM_NAMES`:
`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ...), from the same
data, so that dashboards and autoscalers written for vLLM read this server as is.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from agent_infer.core.protocol import EngineSnapshot

PREFIX = "agent_infer_"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
_PHASE_BUCKETS = _LATENCY_BUCKETS + (160.0, 320.0, 640.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# Our metric (without the agent_infer_ prefix) -> vLLM's name(s) for the same thing; and
# label names vLLM spells differently. request_success counts only requests that ran
# (vLLM's finished reasons: stop, length, abort).
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",),  # the cached prompt tokens
    "num_preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "requests_finished": ("vllm:request_success",),
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_tokens": ("vllm:request_generation_tokens",),
    "iteration_tokens": ("vllm:iteration_tokens_total",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}
_VLLM_LABELS = {"finish_reason": "finished_reason"}
_VLLM_SUCCESS = {"stop", "length", "abort"}


@dataclass(frozen=True)
class StepInfo:
    is_prefill: bool
    num_seqs: int  # prefill: prompts finished in this step; decode: the batch size
    num_tokens: int  # tokens computed (prefill: prompt tokens; decode: one per sequence)
    seconds: float


class _EngineCollector(Collector):
    """Exports the engine's state as it is at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self.snapshot = snapshot

    def describe(self):
        return []  # values come from the snapshot; nothing to check at registration

    def collect(self):
        s = self.snapshot()
        yield _gauge("num_requests_running", "Requests holding KV blocks (prefilling or decoding).", s.num_running)
        yield _gauge("num_requests_waiting", "Requests queued in the scheduler, not yet admitted.", s.num_waiting)
        yield _gauge("kv_cache_usage_ratio", "Fraction of KV blocks in use (prefix-cached free blocks count as free).",
                     s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0)
        yield _gauge("kv_cache_used_blocks", "KV blocks held by requests.", s.num_used_blocks)
        yield _gauge("kv_cache_total_blocks", "KV blocks in the pool.", s.num_blocks)
        yield _gauge("engine_healthy", "1 while the engine loop runs.", 1.0)
        yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield _counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        yield _counter("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", s.prompt_tokens)
        yield _counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield _counter("engine_steps", "Engine steps run.", s.steps)
        yield _counter("num_preemptions", "Requests sent back to the queue by recompute preemption.",
                       s.num_preemptions)
        if s.spec_num_drafts is not None:  # speculative decoding is on
            yield _counter("spec_decode_num_drafts", "Verify rows: a sequence's drafts checked in one step.",
                           s.spec_num_drafts)
            yield _counter("spec_decode_num_draft_tokens", "Draft tokens checked.", s.spec_num_draft_tokens)
            yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft.", labels=["position"])
            for position, count in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([str(position)], count)
            yield per_pos


class _VllmNames(Collector):
    """The metrics of `registry` named in VLLM_NAMES, again under vLLM's names."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def describe(self):
        return []

    def collect(self):
        for family in self.registry.collect():
            short = family.name[len(PREFIX):] if family.name.startswith(PREFIX) else None
            for name in VLLM_NAMES.get(short, ()):
                out = Metric(name, family.documentation, family.type)
                for sample in family.samples:
                    labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
                    if name == "vllm:request_success" and labels.get("finished_reason") not in _VLLM_SUCCESS:
                        continue
                    out.add_sample(name + sample.name[len(family.name):], labels, sample.value, sample.timestamp)
                yield out


class _BulkHistogram(Collector):
    """A histogram that takes a whole engine step's observations in one call (one gap per
    request of a decode batch, every step), for a fraction of what as many
    `Histogram.observe` calls cost the core's loop. Exported like a Histogram."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc = name, doc
        self._bounds = tuple(float(b) for b in buckets) + (math.inf,)
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values) -> None:
        bounds, counts = self._bounds, self._counts
        with self._lock:
            for v in values:
                counts[bisect.bisect_left(bounds, v)] += 1  # the first bucket with v <= le
                self._sum += v

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc)]

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        buckets, cumulative = [], 0
        for bound, count in zip(self._bounds, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class CoreMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Submit to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = _BulkHistogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of one request.",
                                  _LATENCY_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Submit to finish, per request.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.decode_batch = Histogram(PREFIX + "decode_batch_size", "Sequences decoded together in one step.",
                                      buckets=_BATCH_BUCKETS, registry=r)
        self.prefill_batch = Histogram(PREFIX + "prefill_batch_sequences",
                                       "Sequences that finished their prompt together in one prefill step.",
                                       buckets=_BATCH_BUCKETS, registry=r)
        self.prefill_tokens = Histogram(PREFIX + "prefill_batch_tokens", "Prompt tokens computed in one prefill step.",
                                        buckets=_TOKEN_BUCKETS, registry=r)
        self.step_seconds = Histogram(PREFIX + "step_seconds", "Wall time of one engine step.", ["phase"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.requests_received = Counter(PREFIX + "requests_received", "Engine requests accepted (one per choice).",
                                         registry=r)
        self.front_end_requests = Counter(PREFIX + "front_end_requests", "Engine requests accepted, by the front end "
                                          "that sent them (--api-server-count).", ["front_end"], registry=r)
        self.requests_finished = Counter(PREFIX + "requests_finished", "Engine requests ended, by outcome.",
                                         ["finish_reason"], registry=r)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt length per request.",
                                               buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens", "Tokens generated per request.",
                                                   buckets=_TOKEN_BUCKETS, registry=r)
        self.http_errors = Counter(PREFIX + "http_errors", "Error responses sent, by status code.", ["status"],
                                   registry=r)
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens", "Tokens of one engine step's outputs, as vLLM counts them: the whole prompt "
            "of each request that got its first token, and every token generated.", buckets=_ITERATION_BUCKETS,
            registry=r)
        phases = {"queue": "Arrival to first admission (waiting in the queue), per request.",
                  "prefill": "First admission to first token, per request.",
                  "decode": "First token to finish, per request.",
                  "inference": "First admission to finish (prefill + decode), per request."}
        self.phase = {k: Histogram(PREFIX + f"request_{k}_time_seconds", doc, buckets=_PHASE_BUCKETS, registry=r) for k, doc in phases.items()}
        r.register(_EngineCollector(snapshot))
        self.vllm_registry = CollectorRegistry(auto_describe=False)
        self.vllm_registry.register(_VllmNames(r))

    # ---- what the core's loop reports ---------------------------------------------------

    def on_step(self, info: StepInfo) -> None:
        if info.is_prefill:
            self.prefill_tokens.observe(info.num_tokens)
            if info.num_seqs:
                self.prefill_batch.observe(info.num_seqs)
            self.step_seconds.labels("prefill").observe(info.seconds)
        else:
            self.decode_batch.observe(info.num_seqs)
            self.step_seconds.labels("decode").observe(info.seconds)

    def on_requests_added(self, count: int, front_end: str) -> None:
        self.requests_received.inc(count)
        self.front_end_requests.labels(front_end).inc(count)

    def on_iteration(self, num_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)

    def on_token_latencies(self, first_token: list[float], inter_token: list[float]) -> None:
        for seconds in first_token:
            self.ttft.observe(seconds)
        if inter_token:
            self.itl.observe_many(inter_token)

    def on_request_phases(self, queue_s: float, prefill_s: float, decode_s: float, inference_s: float) -> None:
        for key, value in zip(("queue", "prefill", "decode", "inference"), (queue_s, prefill_s, decode_s, inference_s)):
            self.phase[key].observe(max(0.0, value))

    def on_request_finished(self, reason: str, seconds: float, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.requests_finished.labels(reason).inc()
        if reason in ("stop", "length", "abort"):
            self.e2e.observe(seconds)
            self.request_prompt_tokens.observe(num_prompt_tokens)
            self.request_generation_tokens.observe(num_output_tokens)

    def on_http_error(self, status: int) -> None:  # reported by a front end
        self.http_errors.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_registry)


CONTENT_TYPE = CONTENT_TYPE_LATEST


def unavailable_text() -> bytes:
    """What a front end serves on /metrics while the core cannot answer: the health gauge at 0."""
    return (f"# HELP {PREFIX}engine_healthy 1 while the engine loop runs.\n"
            f"# TYPE {PREFIX}engine_healthy gauge\n{PREFIX}engine_healthy 0.0\n").encode()

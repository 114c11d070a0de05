"""Batched sampling: greedy, temperature, top-k, top-p, min-p, penalties, logprobs.

Every row is sampled by an "exponential race": token = argmax(p_i / E_i) with E_i ~ Exp(1),
which draws from p exactly; in log space that is the Gumbel-max trick,
argmax(logits_i / T - log E_i). The E_i come from a counter-based hash of (request seed,
output position, token id), so a request's samples depend on its seed alone — not on
the batch it runs in, nor on any generator state — and need no host loop or sync. On
GPUs one Triton pass over the logits does it (kernels/triton/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_infer.engine.structs import Sequence
from agent_infer.kernels import ops

@dataclass
class SamplingBatch:
    """The sampling settings of one step's rows, as tensors on the logits' device."""

    temperature: torch.Tensor | None  # [B] float32, 0 = greedy (None: every row greedy)
    seeds: torch.Tensor | None  # [B] int64
    steps: torch.Tensor | None  # [B] int64: index of the token being sampled
    top_k: torch.Tensor | None  # [B] int64, vocab size = off
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    all_greedy: bool
    num_logprobs: int  # top logprobs to return; -1: none
    presence: torch.Tensor | None = None  # [B] float32
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # [B, V] float32
    seen_mask: torch.Tensor | None = None  # [B, V] bool: in prompt or output

    @staticmethod
    def from_seqs(seqs: list[Sequence], vocab_size: int, device: torch.device,
                  drafts: list[list[int]] | None = None) -> "SamplingBatch":
        """One row per sequence; with `drafts` (per sequence), 1 + len(drafts) rows each:
        row j samples output token num_output_tokens + j as if drafts[:j] came first
        (its seed position, and the output its penalties count)."""
        params = [s.sampling_params for s in seqs]
        nlp = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
        penalties = any(p.has_penalties for p in params)
        if nlp < 0 and not penalties and all(p.temperature == 0.0 for p in params):
            # The common decode case: argmax only, no per-row tensors to build or copy.
            return SamplingBatch(None, None, None, None, None, None, True, -1)
        rows = [(s, d[:j]) for s, d in zip(seqs, drafts) for j in range(1 + len(d))] if drafts else None
        if rows is not None:
            seqs = [s for s, _ in rows]
            params = [s.sampling_params for s in seqs]
        greedy = [p.temperature == 0.0 for p in params]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        sampled = [p for p in params if p.temperature > 0]
        use_top_k = any(0 < p.top_k < vocab_size for p in sampled)
        batch = SamplingBatch(
            temperature=tensor([p.temperature for p in params], torch.float32),
            seeds=tensor([s.seed for s in seqs], torch.int64),
            steps=tensor([s.num_output_tokens + len(d) for s, d in rows] if rows else
                         [s.num_output_tokens for s in seqs], torch.int64),
            top_k=tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64)
            if use_top_k
            else None,
            top_p=tensor([p.top_p for p in params], torch.float32) if any(p.top_p < 1.0 for p in sampled) else None,
            min_p=tensor([p.min_p for p in params], torch.float32) if any(p.min_p > 0.0 for p in sampled) else None,
            all_greedy=all(greedy),
            num_logprobs=nlp,
        )
        if penalties:
            batch.presence = tensor([p.presence_penalty for p in params], torch.float32)
            batch.frequency = tensor([p.frequency_penalty for p in params], torch.float32)
            batch.repetition = tensor([p.repetition_penalty for p in params], torch.float32)
            outputs = [s.output_token_ids + d for s, d in rows] if rows else [s.output_token_ids for s in seqs]
            batch.output_counts, batch.seen_mask = _token_stats(seqs, outputs, vocab_size, device)
        return batch


def _token_stats(seqs: list[Sequence], outputs: list[list[int]], vocab_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    def padded(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(1, max(len(x) for x in lists))
        ids = torch.zeros(len(lists), width, dtype=torch.int64)
        ones = torch.zeros(len(lists), width, dtype=torch.float32)
        for i, x in enumerate(lists):
            ids[i, : len(x)] = torch.tensor(x, dtype=torch.int64)
            ones[i, : len(x)] = 1.0
        return ids.to(device), ones.to(device)

    out_ids, out_ones = padded(outputs)
    counts = torch.zeros(len(seqs), vocab_size, device=device).scatter_add_(1, out_ids, out_ones)
    prompt_ids, prompt_ones = padded([s.prompt_token_ids for s in seqs])
    seen = torch.zeros(len(seqs), vocab_size, device=device).scatter_add_(1, prompt_ids, prompt_ones)
    return counts, (seen + counts) > 0


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32: logprob of the sampled token
    top_ids: torch.Tensor | None = None  # [B, k] int64
    top_logprobs: torch.Tensor | None = None  # [B, k] float32
    ranks: torch.Tensor | None = None  # [B] int64: rank of the sampled token (with logprobs)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if batch.all_greedy and batch.num_logprobs < 0 and batch.output_counts is None:
            return SamplerOutput(ops.argmax(logits))
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if batch.num_logprobs >= 0 else None
        if batch.output_counts is not None:
            logits = apply_penalties(logits.float(), batch)
        # Greedy rows (T = 0) take the argmax inside the sampling kernel itself.
        tokens = logits.argmax(dim=-1) if batch.all_greedy else self._sample(logits, batch)
        out = SamplerOutput(tokens)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
            out.ranks = token_ranks(raw_logprobs, out.logprobs)
            if batch.num_logprobs > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(batch.num_logprobs, dim=-1)
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.top_k is None and batch.top_p is None and batch.min_p is None:
            return ops.gumbel_sample(logits, batch.temperature, batch.seeds, batch.steps)
        greedy = batch.temperature == 0.0
        ones = torch.ones_like(batch.temperature)
        scaled = logits.float() / torch.where(greedy, ones, batch.temperature)[:, None]
        if batch.top_k is not None or batch.top_p is not None:
            scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
        if batch.min_p is not None:
            # p < min_p * p_max  <=>  scaled < max + log(min_p)
            floor = scaled.amax(dim=-1, keepdim=True) + torch.log(batch.min_p[:, None])
            scaled = scaled.masked_fill(scaled < floor, float("-inf"))
        # Temperature is applied: sample the masked distribution at T = 1 (greedy rows: T = 0,
        # the argmax, which the masks always keep).
        return ops.gumbel_sample(scaled, torch.where(greedy, torch.zeros_like(ones), ones), batch.seeds, batch.steps)


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[R] rank of each row's chosen token: 1 + the entries of its row [R, V] with a
    strictly larger logprob. A comparison and a sum on the device: no host sync."""
    return (logprobs > chosen[:, None]).sum(dim=-1) + 1


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and its top-p nucleus. The most
    likely token always survives."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty (CTRL/HF style, over prompt and output tokens) then OpenAI's
    presence and frequency penalties (over output tokens)."""
    rep = batch.repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(batch.seen_mask, penalised, logits)
    counts = batch.output_counts
    return logits - batch.frequency[:, None] * counts - batch.presence[:, None] * (counts > 0).float()

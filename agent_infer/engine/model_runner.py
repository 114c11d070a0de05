"""Turns a scheduled batch into tensors, runs the model, samples.

Inputs of a step: `input_ids, positions` (flattened over the batch), and the attention
metadata (`slot_mapping, block_tables, context_lens, query_start_loc`). Only the last
position of each sequence that samples goes through the LM head.

With tensor parallelism rank 0 runs `launch` and every worker runs `follow` on the same
`HostStep`: both run the forward pass (whose collectives meet), then rank 0 broadcasts
its sampled tokens to the workers on the device, so that every rank resolves the next
step's placeholder inputs to the same tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from agent_infer.attention.backend import AttentionBackend, backend_class
from agent_infer.attention.metadata import AttentionMetadata, forward_context, longest_first
from agent_infer.config import ConfigError, EngineConfig, ModelConfig
from agent_infer.distributed.state import ParallelState, broadcast_from_first
from agent_infer.engine.cuda_graphs import DecodeGraphs, GraphUnsafe
from agent_infer.engine.host_step import HostStep, build_host_step
from agent_infer.engine.sampler import Sampler, SamplerOutput, SamplingBatch, token_ranks
from agent_infer.engine.scheduler import ScheduledBatch
from agent_infer.engine.structs import Sequence
from agent_infer.kernels import ops
from agent_infer.kvcache.pool import KVMemoryPool, bytes_per_token
from agent_infer.loader.weights import iter_weights
from agent_infer.quantization.fp8 import dequantized, is_fp8
from agent_infer.models.registry import resolve_model_class

log = logging.getLogger(__name__)


@contextmanager
def build_context(device: torch.device, dtype: torch.dtype):
    """Parameters created inside get this device and dtype (restored on exit)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


@dataclass
class StepOutput:
    """What one step produced, on the host: one token per sampling sequence, in batch order
    (with logprobs: its logprob, rank and top-k); and, for sequences that asked for prompt
    logprobs, (logprob, top-k, rank) of the prompt tokens this step computed (per batch
    sequence, in order; empty for the others)."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[list[tuple[float, list[tuple[int, float]], int]]] | None = None
    ranks: list[int] | None = None
    # A draft layer's prediction at every sampling row (speculative method mtp), each as
    # if that row's sampled token is the one that stands: `draft_with_mtp` keeps the row
    # at each sequence's last position that stands.
    drafts: list[int] | None = None
    # The step's input ids as it ran, when the device looked up drafts for some of its
    # rows (HostStep.lookup): the drafts those rows verified.
    input_ids: list[int] | None = None


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens given the tokens before them, for the rows of a prefill
    step listed in `HostStep.prompt_lp_rows`: the target token's logprob [R] and rank [R],
    and the top-k [R, k] (k = 0: none)."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    ranks: torch.Tensor | None = None


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the hidden states that go through the LM head


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        tp: ParallelState,
    ):
        self.model_config = model_config
        self.config = engine_config
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = engine_config.resolve_kv_cache_dtype(dtype)
        self.max_model_len = max_model_len
        self.tp = tp
        self.block_size = engine_config.block_size
        self.sampler = Sampler()
        self.model = self._load_model()
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self.model.use_torch_compile()
        # What each attention layer caches per token; the engine itself never looks inside.
        self.cache_layouts = [layer.cache_layout for layer in self.model.attention_layers]
        self.backend = self._make_backend()
        self.pool: KVMemoryPool | None = None
        self.graphs: DecodeGraphs | None = None
        # The sampled tokens of the last step that sampled (on a TP worker: rank 0's,
        # received by broadcast), read by the next step's placeholder inputs; and, when
        # it verified drafts, its input ids, which say how many of them it accepted.
        self._prev_tokens: torch.Tensor | None = None
        self._prev_inputs: torch.Tensor | None = None
        # How far the step's decode rows moved back on the device (None: not at all), for
        # the seed positions of their samples.
        self._row_shift: torch.Tensor | None = None
        spec = engine_config.speculative_config
        self._max_drafts = spec.num_speculative_tokens if spec is not None else 0
        # Prompt lookup's (min, max) match lengths, for rows whose drafts the device finds.
        self._lookup = (spec.prompt_lookup_min, spec.prompt_lookup_max) if spec is not None and spec.method == "ngram" \
            else None
        self._received_tokens: torch.Tensor | None = None  # a TP worker's receive buffer
        # A draft layer (speculative method mtp) reads the last step's inputs and hidden
        # states, and its drafts are read off the rows of the step it followed.
        self._last: _LastStep | None = None
        self._drafted: HostStep | None = None

    # ---- set-up --------------------------------------------------------------------

    def _load_model(self) -> torch.nn.Module:
        cls = resolve_model_class(self.model_config.architecture, self.model_config.impl)
        spec = self.config.speculative_config
        self.uses_draft_layer = spec is not None and spec.method == "mtp"
        with build_context(self.device, self.dtype):
            model = cls(self.model_config, self.tp, self.max_model_len)
            if self.uses_draft_layer:
                if not getattr(model, "num_draft_layers", 0):
                    raise ConfigError(f"speculative method mtp needs a checkpoint with a multi-token-prediction "
                                      f"layer; this {self.model_config.architecture} has none")
                model.enable_draft_layer()
        weights = iter_weights(self.model_config.path)
        quant = self.config.resolve_quantization(self.model_config.quantization)
        if quant is not None:  # which weights an fp8 checkpoint stores in e4m3 (online: all that can be)
            stored = [] if quant.online else [n for n, w in iter_weights(self.model_config.path) if is_fp8(w)]
            model.use_fp8(quant, stored)
        if self.model_config.quantization is not None:
            weights = dequantized(weights, self.model_config.quantization)
        model.load_weights(weights)
        if self.config.batch_invariant:
            model.use_batch_invariance(self.config.max_decode_rows)
        return model.eval()

    def _step_kind(self, decode: bool) -> None:
        """Tell the batch-invariant mode's projections (if on) whether a decode step runs."""
        if self.model.invariance is not None:
            self.model.invariance.decoding(decode)

    def _make_backend(self) -> AttentionBackend:
        """One backend for the model's layout (every attention layer of a model shares its
        kind), from the registry by layout and device."""
        layout = self.cache_layouts[0]
        if any(other.kind != layout.kind for other in self.cache_layouts):
            raise ConfigError(f"{type(self.model).__name__} mixes cache layouts; one backend serves one layout")
        cls = backend_class(layout, self.device, self.config.attention_backend)
        cls.check_cache_dtype(self.kv_cache_dtype, self.dtype)
        return cls(self.model.attention_layers[0], self.config.max_decode_rows, self.device,
                   batch_invariant=self.config.batch_invariant)

    def cache_bytes_per_token(self) -> int:
        """KV-cache bytes one token costs on this rank, over all layers."""
        return bytes_per_token(self.cache_layouts, self.kv_cache_dtype)

    def init_kv_cache(self, num_blocks: int, dtype: torch.dtype | None = None) -> None:
        """Allocate the pool (in `dtype`, default the configured cache dtype) and bind it."""
        self.pool = KVMemoryPool(self.cache_layouts, self.block_size, num_blocks, dtype or self.kv_cache_dtype,
                                 self.device)
        for layer, view in zip(self.model.attention_layers, self.pool.views):
            layer.bind(view, self.backend)

    def _release_kv_cache(self) -> None:
        self.pool = None
        for layer in self.model.attention_layers:
            layer.bind(None, None)

    def _single_prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """One sequence's prefill of `ids` into cache slots [0, len) of the bound pool
        (blocks 0, 1, ...); returns the final hidden states."""
        self._step_kind(decode=False)
        num_tokens = ids.numel()
        blocks = -(-num_tokens // self.block_size)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=positions.clone(),
            block_tables=torch.arange(blocks, device=self.device, dtype=torch.int32)[None, :],
            context_lens=torch.tensor([num_tokens], device=self.device, dtype=torch.int32),
            query_start_loc=torch.tensor([0, num_tokens], device=self.device, dtype=torch.int32),
            max_query_len=num_tokens,
            query_lens_host=[num_tokens],
            context_lens_host=[num_tokens],
            block_tables_host=np.arange(blocks, dtype=np.int32)[None, :],
        )
        with forward_context(self.backend.prepare(meta)):
            return self.model(ids, positions)

    @torch.inference_mode()
    def measure_kv_amax(self, token_ids: list[int]) -> torch.Tensor:
        """[layers, parts] fp32: each attention layer's largest cached values after one
        prefill of `token_ids` into a throwaway cache of the model's dtype (what
        --calculate-kv-scales derives the fp8 cache's scales from; kvcache/calibration.py).
        A start-up step: it leaves no cache bound."""
        layers = self.model.attention_layers
        if not all(hasattr(layer, "calibration_amax") for layer in layers):
            raise ConfigError(f"--calculate-kv-scales: the attention layers of {self.model_config.architecture} "
                              f"(model impl {self.model_config.impl}) take no KV-cache scales")
        self.init_kv_cache(-(-len(token_ids) // self.block_size), dtype=self.dtype)
        self._single_prefill(torch.tensor(token_ids, dtype=torch.int64, device=self.device))
        amax = torch.stack([layer.calibration_amax(len(token_ids)) for layer in layers])
        self._release_kv_cache()
        return amax

    def use_kv_scales(self, amax: torch.Tensor) -> None:
        """Each attention layer's scales from its row of `measure_kv_amax` (maximum over ranks)."""
        for layer, row in zip(self.model.attention_layers, amax):
            layer.use_calibrated_scales(row)

    def capture_graphs(self) -> None:
        """Capture decode graphs (GPU, unless --enforce-eager). Needs the KV cache bound."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.model.cuda_graphs:
            return
        max_blocks = -(-self.max_model_len // self.block_size)
        graphs = DecodeGraphs(self.model, min(self.config.max_decode_rows, 512), max_blocks, self.device,
                              self.backend, draft_layer=self.uses_draft_layer)
        self._step_kind(decode=True)
        try:
            graphs.capture()
        except GraphUnsafe as e:
            log.warning("decode runs without CUDA graphs: a step of %s synchronises with the host (%s)",
                        self.model_config.architecture, e)
            return
        self.graphs = graphs

    def eager_decode_batches(self) -> tuple[list[int], list[int]]:
        """Decode-row counts for the start-up warm-up to run eagerly, so that no eager step
        compiles a decode-kernel variant later: (plain decode steps, which run eagerly
        without graphs; the decode rows of mixed steps, which always do). Up to
        max_num_seqs rows, what plain steps can hold: a verify step's extra rows (k per
        drafting sequence) take graphs up to their size, and past it may compile a
        variant on first use."""
        n = self.config.max_num_seqs
        plain = [] if self.graphs is not None else self.backend.eager_decode_batches(n, mixed=False)
        mixed = self.backend.eager_decode_batches(n - 1, mixed=True) if self.config.mixed_batches else []
        return plain, mixed

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, num_seqs: int) -> int:
        """Peak activation bytes of the largest step (a prefill of `num_tokens`) plus the
        sampler on `num_seqs` rows, measured with a throwaway cache (GPU only)."""
        if self.device.type != "cuda":
            return 0
        self.init_kv_cache(-(-num_tokens // self.block_size))
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        hidden = self._single_prefill(torch.randint(0, self.model_config.vocab_size, (num_tokens,), device=self.device))
        rows = min(num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[-rows:])
        torch.log_softmax(logits.float(), dim=-1).sort(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del hidden, logits
        self._release_kv_cache()
        torch.cuda.empty_cache()
        return max(0, peak)

    # ---- one step ------------------------------------------------------------------

    def build_step(self, batch: ScheduledBatch) -> HostStep:
        step = build_host_step(batch, self.block_size)
        if self.uses_draft_layer and step.is_prefill:
            step.next_ids = _next_ids(batch, step)
        return step

    def prepare(self, step: HostStep) -> PreparedInputs:
        dev = self.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        meta = AttentionMetadata(
            is_prefill=step.is_prefill,
            slot_mapping=to_dev(step.slot_mapping),
            block_tables=to_dev(step.block_tables),
            context_lens=to_dev(step.context_lens),
            query_start_loc=to_dev(step.query_start_loc),
            max_query_len=int(step.query_lens.max()),
            query_lens_host=step.query_lens.tolist(),
            context_lens_host=step.context_lens.tolist(),
            num_decode=step.num_decode,
            decode_order=None if step.is_prefill else to_dev(longest_first(step.context_lens)),
            block_tables_host=step.block_tables,
        )
        input_ids = to_dev(step.input_ids)
        positions = to_dev(step.positions)
        if step.follow is not None:
            shift = torch.empty_like(positions)
            self.resolve_rows(step, input_ids, positions, meta.slot_mapping, meta.context_lens, shift,
                              to_dev(step.prev_index), to_dev(step.follow), to_dev(step.follow_k), meta.block_tables)
            if self.backend.reads_decode_lens_on_host:
                meta.context_lens_host = meta.context_lens.tolist()
        elif step.prev_index is not None:
            assert self._prev_tokens is not None, "placeholder inputs without a previous step"
            input_ids = ops.fill_placeholders(input_ids, to_dev(step.prev_index), self._prev_tokens)
        if step.lookup is not None:
            self.lookup_drafts(step, input_ids)
        meta = self.backend.prepare(meta)
        return PreparedInputs(input_ids, positions, meta, to_dev(step.sample_indices))

    def compile_row_moves(self) -> None:
        """Compile `ops.resolve_rows` and (prompt lookup) `ops.lookup_drafts` for a GPU
        engine that drafts: one launch each on one row, which is all their single
        variants need (warm-up)."""
        if self._max_drafts and self.device.type == "cuda":
            one = torch.zeros(1, dtype=torch.int64, device=self.device)
            ops.resolve_rows(one.clone(), one.clone(), one.clone(), one.to(torch.int32), one.clone(), one - 1,
                             one - 1, one.clone(), one.view(1, 1).to(torch.int32), self.block_size, one, one,
                             self._max_drafts)
            if self._lookup is not None:
                ids, offsets = torch.zeros(2, dtype=torch.int64, device=self.device), torch.tensor([0, 1]).to(one)
                ops.lookup_drafts(ids, one, offsets, one, one, one, one, one, one, *self._lookup, self._max_drafts)

    def resolve_rows(self, step: HostStep, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     context_lens: torch.Tensor, shift: torch.Tensor, prev_index: torch.Tensor, follow: torch.Tensor,
                     follow_k: torch.Tensor, block_tables: torch.Tensor) -> None:
        """The step's rows that follow a verify row still in flight, moved back on the
        device by the drafts it rejected, and its placeholder inputs filled
        (`ops.resolve_rows`); `shift` keeps each decode row's move for its sampler."""
        assert self._prev_tokens is not None and self._prev_inputs is not None, "rows follow no verify step"
        ops.resolve_rows(input_ids, positions, slots, context_lens, shift, prev_index, follow, follow_k,
                         block_tables, self.block_size, self._prev_tokens, self._prev_inputs, self._max_drafts)
        self._row_shift = shift[: step.num_decode if step.is_prefill else len(step.input_ids)]

    def lookup_drafts(self, step: HostStep, input_ids: torch.Tensor) -> None:
        """The drafts of the step's rows drafted behind a row still in flight, looked up on
        the device in the text that row really gave (`ops.lookup_drafts`), into their
        draft slots of `input_ids`; after placeholders are resolved (the step's own ids
        are not read)."""
        assert self._prev_tokens is not None and self._lookup is not None, "a lookup row follows no step"
        lookup = step.lookup
        packed = torch.from_numpy(lookup.packed).to(self.device, non_blocking=True)
        r = lookup.num_rows
        offsets, starts, slots, refs, ref_k = (packed[: r + 1], *packed[r + 1 : 5 * r + 1].view(4, r))
        # (Behind plain rows only, no input ids were kept, and no draft of theirs is read.)
        prev_inputs = self._prev_inputs if self._prev_inputs is not None else self._prev_tokens
        ops.lookup_drafts(input_ids, packed[5 * r + 1 :], offsets, starts, slots, refs, ref_k, self._prev_tokens,
                          prev_inputs, *self._lookup, self._max_drafts)

    @torch.inference_mode()
    def execute(self, step: HostStep) -> tuple[torch.Tensor, PromptLogprobs | None]:
        """Forward pass; returns the logits of the sampling rows [num_sampling, vocab] and
        the prompt logprobs the step asks for (None when none)."""
        self._step_kind(decode=not step.is_prefill)
        self._row_shift = None
        if not step.is_prefill and self.graphs is not None and self.graphs.can_run(len(step.input_ids)):
            hidden, logits = self.graphs.run(step, self._prev_tokens, self.resolve_rows, self.lookup_drafts)
            # The next step may follow this one's verify rows: their drafts, outside the
            # static buffers that its staging overwrites.
            self._prev_inputs = self.graphs.input_ids(step).clone() if step.has_drafts else None
            if self.uses_draft_layer:
                self._last = _LastStep(step)  # the draft graph reads the step's buffers before the next replay
            return logits, None  # every decode row samples
        inputs = self.prepare(step)
        self._prev_inputs = inputs.input_ids if step.has_drafts else None
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        if self.uses_draft_layer:
            self._last = _LastStep(step, hidden, inputs)
        prompt_lp = self._prompt_logprobs(hidden, step) if step.prompt_lp_rows is not None else None
        return self.model.compute_logits(hidden[inputs.sample_indices]), prompt_lp

    def _prompt_logprobs(self, hidden: torch.Tensor, step: HostStep, rows_per_pass: int = 1024) -> PromptLogprobs:
        """log_softmax over the vocabulary at each listed row, a bounded number of rows at a
        time (a row of fp32 logprobs is vocab x 4 bytes). Every TP rank runs this: the
        vocabulary-parallel LM head gathers across ranks."""
        rows = torch.from_numpy(step.prompt_lp_rows).to(self.device, non_blocking=True)
        targets = torch.from_numpy(step.prompt_lp_targets).to(self.device, non_blocking=True)
        k = step.prompt_lp_k
        lps, ranks, top_ids, top_lps = [], [], [], []
        for lo in range(0, rows.numel(), rows_per_pass):
            logits = self.model.compute_logits(hidden[rows[lo : lo + rows_per_pass]])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            target_lps = logprobs.gather(1, targets[lo : lo + rows_per_pass, None]).squeeze(1)
            lps.append(target_lps)
            ranks.append(token_ranks(logprobs, target_lps))
            if k > 0:
                values, ids = logprobs.topk(k, dim=-1)
                top_lps.append(values)
                top_ids.append(ids)
        return PromptLogprobs(
            torch.cat(lps), torch.cat(top_ids) if k > 0 else None, torch.cat(top_lps) if k > 0 else None,
            torch.cat(ranks),
        )

    @torch.inference_mode()
    def launch(
        self, step: HostStep, sampling_seqs: list[Sequence],
        process_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
        drafts: list[list[int]] | None = None,
    ) -> InFlight:
        """Queue the forward pass and sampling (rank 0) without waiting for them;
        `sampling_seqs` are the batch's sequences that sample, in batch order (one per
        row of `step.sample_indices`; with `drafts`, per sequence, 1 + len(drafts) rows
        each: a verify row samples at every position). The sampled tokens stay on the device for the next
        step's placeholder inputs (and go to the TP workers, see `follow`) and are copied
        to the host in the background. `process_logits`, when given, runs on the host
        after the forward pass is queued and before sampling (structured-output masks,
        logit bias: agent_infer/structured), so its host work overlaps the forward pass."""
        logits, prompt_lp = self.execute(step)
        if not sampling_seqs:  # the workers skip the broadcast too: S = 0 in the step
            if self.uses_draft_layer:
                self._draft_pass(None)  # the draft layer's K/V of the chunks' rows
            return InFlight.start(None, prompt_lp, step, self.device)
        sampling = SamplingBatch.from_seqs(sampling_seqs, self.model_config.vocab_size, self.device, drafts)
        if self._row_shift is not None and sampling.steps is not None:
            # Rows moved back sample the output positions they really hold.
            n = len(self._row_shift)
            sampling.steps[:n] += self._row_shift
        if process_logits is not None:
            logits = process_logits(logits)
        out = self.sampler(logits, sampling)
        self._prev_tokens = broadcast_from_first(out.tokens, self.tp)
        drafts = self._draft_pass(out.tokens) if self.uses_draft_layer else None
        inputs = self._prev_inputs if step.lookup is not None else None
        return InFlight.start(out, prompt_lp, step, self.device, drafts, inputs)

    def _draft_pass(self, sampled: torch.Tensor | None) -> torch.Tensor | None:
        """The draft layer (speculative method mtp) over every row of the step just run,
        queued right after its sampler: row p takes the step's h_p and t_{p+1}, the token
        sampled at p where p samples (on the device: wherever the row stands, that is
        what follows it) and the prompt's next token elsewhere (`HostStep.next_ids`),
        through the step's own attention metadata (a decode step that replayed a graph
        replays the draft layer's twin of it). That writes the layer's K/V at every
        row; rows past a rejected draft write garbage at positions the next step writes
        again before anything reads them, as the main layers' rejected rows do. Returns
        the argmax at every sampling row, on the device (None when none samples);
        `draft_with_mtp` keeps the rows that stand."""
        last, self._last = self._last, None
        self._drafted = last.step
        if last.inputs is None:  # (a replayed decode step: its rows all sample)
            return self.graphs.draft(sampled)
        inputs = last.inputs
        if not last.step.is_prefill:  # every row samples
            ids = sampled
        else:
            assert last.step.next_ids is not None, "build_step gives a step with prompt rows its next_ids"
            ids = torch.from_numpy(last.step.next_ids).to(self.device, non_blocking=True)
            if sampled is not None:
                ids[inputs.sample_indices] = sampled
        with forward_context(inputs.meta):
            out = self.model.draft_hidden(ids, last.hidden, inputs.positions)
        if sampled is None:
            return None
        return ops.argmax(self.model.compute_logits(out[inputs.sample_indices]))

    @torch.inference_mode()
    def follow(self, step: HostStep) -> None:
        """A TP worker's step: the forward pass, then rank 0's sampled tokens received
        into `_prev_tokens` (a device-side broadcast, no host sync), so the next step's
        placeholder inputs resolve exactly as on rank 0. The collectives come in the
        same order as in rank 0's `launch`: the forward pass's, then the broadcast —
        which every rank skips when the step samples nothing (S is in the step)."""
        self.execute(step)
        num_sampled = len(step.sample_indices)
        if num_sampled:
            self._prev_tokens = broadcast_from_first(self._receive_buffer(num_sampled), self.tp)

    def _receive_buffer(self, n: int) -> torch.Tensor:
        """One buffer reused every step: the device stream orders this step's reads of the
        previous tokens (placeholder fill) before the broadcast that overwrites them."""
        buf = self._received_tokens
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, self.config.max_decode_rows), dtype=torch.int64, device=self.device)
            self._received_tokens = buf
        return buf[:n]

    def draft_with_mtp(self, batch: ScheduledBatch, drafts: list[int] | None) -> list[tuple[Sequence, int]]:
        """(sequence, draft) for each sequence of `batch` (the step `_draft_pass` followed,
        now resolved) whose last row that stands predicts its next unknown token: the
        draft layer's argmax there (`drafts`, one per sampling row)."""
        step, self._drafted = self._drafted, None
        assert step is not None, "draft_with_mtp follows the step it drafts from"
        if drafts is None:
            return []
        # A row that stands last but did not sample ends a chunk one token short of its
        # prompt: the next step computes that token, and drafts after it.
        sample_of_row = {int(r): i for i, r in enumerate(step.sample_indices)}
        return [(seq, drafts[sample_of_row[first + n - 1]]) for seq, first, start, n in _kept_rows(batch, step)
                if start + n == seq.num_tokens - 1 and first + n - 1 in sample_of_row]

    def collect(self, inflight: InFlight) -> StepOutput:
        """Wait for a launched step; its results on the host (the step's one sync)."""
        return inflight.wait()


@dataclass
class _LastStep:
    """What a draft layer reads of the step it follows: the step, and for an eager pass its
    final hidden states and inputs (a replayed graph keeps both in its static buffers)."""

    step: HostStep
    hidden: torch.Tensor | None = None
    inputs: PreparedInputs | None = None


def _next_ids(batch: ScheduledBatch, step: HostStep) -> np.ndarray:
    """t_{p+1} at each input row p of a step with prompt rows, where the host knows it
    (the prompt's, or a token resolved before); rows where it is still to be sampled get
    a placeholder 0, which the draft pass replaces with the sampled token."""
    out = np.zeros(len(step.input_ids), dtype=np.int64)
    for i, seq in enumerate(batch.seqs):
        first, end = step.token_range(i)
        if end > first:
            out[first : end - 1] = step.input_ids[first + 1 : end]
            p = int(step.positions[end - 1]) + 1
            if p < seq.num_tokens:
                out[end - 1] = seq.token_at(p)
    return out


def _kept_rows(batch: ScheduledBatch, step: HostStep) -> list[tuple[Sequence, int, int, int]]:
    """(sequence, first row, its position, n) for each unfinished sequence of `batch` whose
    first n rows of `step` now have their next token known (the rest were rejected
    drafts, or the last row, whose next token is not yet known)."""
    kept = []
    for i, seq in enumerate(batch.seqs):
        first, end = step.token_range(i)
        start = int(step.positions[first])
        n = min(end - first, seq.num_tokens - 1 - start)
        if not seq.is_finished and n > 0:
            kept.append((seq, first, start, n))
    return kept


class InFlight:
    """A launched step's sampler output (prompt logprobs, a draft layer's row drafts, the
    input ids of a step whose drafts were looked up on the device), being copied to
    pinned host memory."""

    def __init__(
        self, host: SamplerOutput | None, prompt: PromptLogprobs | None = None,
        prompt_counts: np.ndarray | None = None, event=None, drafts: torch.Tensor | None = None,
        inputs: torch.Tensor | None = None,
    ):
        self.host, self.prompt, self.prompt_counts, self.event = host, prompt, prompt_counts, event
        self.drafts, self.inputs = drafts, inputs

    @staticmethod
    def start(out: SamplerOutput | None, prompt: PromptLogprobs | None, step: HostStep, device: torch.device,
              drafts: torch.Tensor | None = None, inputs: torch.Tensor | None = None) -> InFlight:
        if device.type != "cuda" or (out is None and prompt is None):
            return InFlight(out, prompt, step.prompt_lp_counts, drafts=drafts, inputs=inputs)  # nothing to wait for

        def copy(t):
            return None if t is None else t.to("cpu", non_blocking=True)

        host = None if out is None else SamplerOutput(
            copy(out.tokens), copy(out.logprobs), copy(out.top_ids), copy(out.top_logprobs), copy(out.ranks)
        )
        if prompt is not None:
            prompt = PromptLogprobs(copy(prompt.logprobs), copy(prompt.top_ids), copy(prompt.top_logprobs),
                                    copy(prompt.ranks))
        drafts, inputs = copy(drafts), copy(inputs)
        event = torch.cuda.Event()
        event.record()
        return InFlight(host, prompt, step.prompt_lp_counts, event, drafts, inputs)

    def wait(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()
        result = StepOutput(tokens=[]) if self.host is None else to_host(self.host)
        if self.prompt is not None:
            result.prompt_logprobs = _split_prompt_logprobs(self.prompt, self.prompt_counts)
        if self.drafts is not None:
            result.drafts = self.drafts.tolist()
        if self.inputs is not None:
            result.input_ids = self.inputs.tolist()
        return result


def _split_prompt_logprobs(p: PromptLogprobs, counts: np.ndarray
                           ) -> list[list[tuple[float, list[tuple[int, float]], int]]]:
    lps = p.logprobs.tolist()
    ranks = p.ranks.tolist()
    ids = p.top_ids.tolist() if p.top_ids is not None else None
    tops = p.top_logprobs.tolist() if p.top_logprobs is not None else None
    out, at = [], 0
    for n in counts.tolist():
        out.append([(lps[r], list(zip(ids[r], tops[r])) if ids is not None else [], ranks[r])
                    for r in range(at, at + n)])
        at += n
    return out


def to_host(out: SamplerOutput) -> StepOutput:
    """The step's one device->host read."""
    if out.logprobs is None:
        return StepOutput(tokens=out.tokens.tolist())
    tokens = out.tokens.tolist()
    logprobs = out.logprobs.tolist()
    top = None
    if out.top_ids is not None:
        ids, lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        top = [list(zip(i, lp)) for i, lp in zip(ids, lps)]
    return StepOutput(tokens, logprobs, top, ranks=out.ranks.tolist() if out.ranks is not None else None)

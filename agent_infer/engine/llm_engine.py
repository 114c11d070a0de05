"""LLMEngine: routes the checkpoint to a model, sizes the KV pool, and drives
schedule -> run -> postprocess one step at a time."""

from __future__ import annotations

import functools
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Sequence as Seq

import torch

from agent_infer.config import ConfigError, EngineConfig, ModelConfig
from agent_infer.distributed.control import WorkerError
from agent_infer.distributed.group import torchrun_launch
from agent_infer.distributed.state import SINGLE
from agent_infer.distributed.workers import WorkerGroup, local_launch, rank_device
from agent_infer.engine.block_manager import BlockManager, PrefixCacheStats
from agent_infer.engine.detokenizer import RequestText
from agent_infer.engine.model_runner import StepOutput
from agent_infer.engine.outputs import RequestOutput, TokenLogprob
from agent_infer.engine.runner_setup import setup_runner
from agent_infer.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from agent_infer.engine.structs import FinishReason, Sequence, SequenceStatus
from agent_infer.engine.warmup import warm_up
from agent_infer.loader.tokenizer import eos_token_ids, load_tokenizer, load_tokenizer_if_any, tokenizer_path
from agent_infer.models.registry import resolve_model_class
from agent_infer.sampling_params import SamplingParams
from agent_infer.speculative.mtp import MtpDrafter
from agent_infer.speculative.ngram import NgramDrafter
from agent_infer.speculative.policy import DraftPolicy
from agent_infer.structured.constraints import Constraints
from agent_infer.structured.grammar import GrammarCompiler, GrammarError

log = logging.getLogger(__name__)

WORKER_ENTRY = "agent_infer.engine.worker"  # what a local worker process runs

# Text, token ids, or vLLM's prompt dicts: {"prompt": text} (TextPrompt) and
# {"prompt_token_ids": ids} (TokensPrompt).
Prompt = str | list[int] | dict


class RequestError(ValueError):
    """A request that cannot be accepted (bad prompt); nothing was queued."""


def unpack_prompt(prompt: Prompt) -> str | list[int]:
    """The text or token ids of a prompt, vLLM's prompt dicts included (which may also
    hold a `cache_salt`, which `add_request` reads)."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt) - {"cache_salt"}
    if keys == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    if keys == {"prompt"}:
        return prompt["prompt"]
    raise RequestError(
        f"a prompt dict holds either 'prompt' (text) or 'prompt_token_ids' (a list of ids), and optionally "
        f"'cache_salt'; got keys {sorted(set(prompt))}"
    )


def check_cache_salt(cache_salt) -> str | None:
    """A cache salt is a non-empty string (or None: no salt). Raises RequestError."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise RequestError("cache_salt must be a non-empty string")
    return cache_salt


@dataclass
class _Request:
    seq: Sequence
    text: RequestText | None  # None: the engine produces no text (see LLMEngine's `detokenize`)
    sent_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # grows with the output, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # built once the whole prompt has them


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True):
        """Rank 0's engine (the only one without tensor parallelism), which starts the other
        ranks as local worker processes; under torchrun it joins those the launcher
        started, and ranks > 0 run `engine.launch.launch_engine` instead.

        `detokenize=False`: outputs carry token ids only (no text), and stop strings are
        left to the caller, as the server's engine core leaves them to its front ends."""
        self.config = config
        self.detokenize = detokenize
        self.model_config = ModelConfig.from_hf(config.model, config.model_impl)
        launch = torchrun_launch()
        tp_size = config.tensor_parallel_size
        if launch is not None:
            if launch.rank != 0:
                raise ConfigError("under torchrun, ranks > 0 serve rank 0's engine: start it with "
                                  "agent_infer.engine.launch.launch_engine(config), as LLM(...) does")
            if tp_size not in (1, launch.world_size):
                raise ConfigError(f"--tp {tp_size} but torchrun started {launch.world_size} processes")
            tp_size = launch.world_size
            config = replace(config, tensor_parallel_size=tp_size)
            self.config = config
        model_class = resolve_model_class(self.model_config.architecture, self.model_config.impl)
        model_class.check_parallel(self.model_config, tp_size, config.moe_parallel)
        self.device = rank_device(config, 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = config.resolve_dtype(self.device)
        tok_path = tokenizer_path(config.tokenizer, config.model)
        self.tokenizer = load_tokenizer_if_any(tok_path)
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        # Structured outputs: grammars compiled (and cached) for the whole process; the
        # server validates requests with it too. Its tokenizer side is built on first use.
        self.grammar = (GrammarCompiler(lambda: load_tokenizer(tok_path), self.model_config.vocab_size,
                                        sorted(self.eos_token_ids))
                        if self.tokenizer is not None else None)

        self.workers: WorkerGroup | None = None
        tp = SINGLE
        if tp_size > 1:
            self.workers = WorkerGroup(config, launch or local_launch(tp_size), self.device, WORKER_ENTRY)
            tp = self.workers.tp
        try:
            self.runner, plan = setup_runner(config, self.model_config, self.device, self.dtype, tp, self.tokenizer)
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = plan.max_model_len
        self.block_manager = BlockManager(plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, config.preemption_mode,
                config.mixed_batches, one_prompt_per_prefill=config.batch_invariant,
            ),
            self.block_manager,
            self.eos_token_ids,
        )
        self._requests: dict[str, _Request] = {}
        self._pending: list[RequestOutput] = []  # reported by the next step (rejections, aborts)
        self._inflight: tuple[ScheduledBatch, object] | None = None  # launched, not read back
        self._penalty_requests: set[str] = set()
        # Speculative decoding: drafts proposed on the host before each decode step that
        # the policy lets carry them (agent_infer/speculative).
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.drafter: NgramDrafter | MtpDrafter | None = None
        if spec is not None:
            self.drafter = (MtpDrafter(self.runner) if spec.method == "mtp"
                            else NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max))
        self.draft_policy = DraftPolicy(spec.disable_by_batch_size if spec is not None else None)
        # Masks and biases of constrained requests (agent_infer/structured), rank 0 only.
        self.constraints = Constraints(self.grammar, self.model_config.vocab_size, self.eos_token_ids, self.device,
                                       config.max_decode_rows)
        self._early_outputs: list[RequestOutput] = []  # read back inside a constrained launch
        # Overlap keeps the sampled tokens on the device (TP workers get them by a device
        # broadcast, see workers.py). Recompute preemption would re-prefill tokens the
        # host does not know yet, so it runs synchronously; so does an MTP draft layer,
        # which runs after each step on its tokens.
        self.async_scheduling = (config.async_scheduling and config.preemption_mode == "none"
                                 and not self.runner.uses_draft_layer)
        # A verify step is not read back before the next step is launched: that step's
        # rows are placed as if every draft is accepted and moved back on the device by
        # those that are not (Scheduler, ops.resolve_rows), so the host's work overlaps
        # the device's for verify steps too (`chain_verify_steps`, on by default).
        self._overlap_verify = self.async_scheduling and (spec is None or spec.chain_verify_steps)
        # Prompt lookup drafts behind the row in flight, on a guess of what it gives
        # (`_propose_behind`): looking for drafts then costs no overlap either.
        self._draft_behind = self.async_scheduling and isinstance(self.drafter, NgramDrafter)
        self._last_read_back: float | None = None  # when the last step was read back (`_time_for_policy`)
        # Called right after each step is queued on the device (before the previous step
        # is read back): the server hands out the last outputs then, while the device works.
        self.on_launched: Callable[[], None] | None = None
        self._ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._generation_ids: list[str] = []
        self._generation_outputs: dict[str, RequestOutput] = {}
        self.stats = EngineStats()
        if config.warmup and self.device.type == "cuda":
            try:
                log.info("warm-up (kernel compilation before the first request): %.1f s", warm_up(self))
            except BaseException:
                self.shutdown()
                raise

    def reset_history(self) -> None:
        """Forget what has run (the start-up warm-up): the prefix cache and every counter.
        Only on an idle engine: live requests keep their blocks, but their cached keys go."""
        assert not self.has_unfinished_requests(), "reset_history needs an idle engine"
        self.block_manager.reset_prefix_cache()
        self.block_manager.stats = PrefixCacheStats()
        self.stats = EngineStats()

    # ---- requests ------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        prompt = unpack_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model directory has no tokenizer: pass token ids as the prompt")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:3]}")
        return ids

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        stream: bool = False,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Queue a request. An empty or invalid prompt raises RequestError; one longer than
        the context is REJECTED (reported by the next step) and never queued. With a
        `cache_salt` (or a prompt dict's), the request shares prefix-cache blocks only
        with requests of the same salt."""
        params = params or SamplingParams()
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        cache_salt = check_cache_salt(cache_salt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt = unpack_prompt(prompt)
        ids = self.tokenize(prompt_token_ids if prompt_token_ids is not None else prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            max_tokens=max(1, max_tokens),
            seed=params.seed if params.seed is not None else self._seed_rng.getrandbits(63),
            prompt=prompt if isinstance(prompt, str) else None,
            cache_salt=cache_salt,
        )
        text = RequestText(self.tokenizer, ids, params, stream) if self.detokenize else None
        req = _Request(seq, text, logprobs=[] if params.logprobs is not None else None)
        if params.constrained:
            try:
                self.constraints.add(seq)
            except (GrammarError, ValueError) as e:
                raise RequestError(str(e)) from None
        if not self.scheduler.add(seq):
            self.constraints.remove(request_id)
            self._pending.append(self._output(req))
            return seq
        self._requests[request_id] = req
        if params.has_penalties:
            self._penalty_requests.add(request_id)
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks at once. False if it is not live."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._forget(request_id)
        self.scheduler.abort(req.seq)
        self._pending.append(self._output(req))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- stepping ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance by one batch; returns an output for every request that changed.

        With async scheduling (no recompute preemption, no penalties in play; TP workers
        or not) the batch is launched before the previous one's tokens are read back, so
        the host's bookkeeping overlaps the device's work; outputs then trail the device
        by one step. Otherwise each batch is launched and read back in the same call."""
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        if self._inflight is not None and self._penalty_requests:
            outputs += self._resolve()  # penalties need every earlier token on the host
        candidates = self._draft_candidates()
        looked_serially = False
        if candidates and not self._propose_behind(candidates):
            if self._inflight is not None:
                outputs += self._resolve()  # drafts follow the last token, which must be known
                looked_serially = True
            self._propose(candidates)
        batch = self.scheduler.schedule()
        if batch is None:
            if self._inflight is not None:
                outputs += self._resolve()
            elif self.scheduler.running and not self.scheduler.waiting:
                raise RuntimeError("scheduler produced no work while requests are running")
            return outputs
        batch.started_s, batch.looked_serially = t0, looked_serially
        launched = self._launch(batch)
        if self._early_outputs:
            outputs += self._early_outputs
            self._early_outputs = []
        if self._inflight is not None:
            outputs += self._resolve()
        self._inflight = launched
        if not self.async_scheduling or (batch.num_draft_tokens and not self._overlap_verify):
            outputs += self._resolve()
        return outputs

    def _draft_room(self, seq: Sequence) -> int:
        """Drafts a step may give `seq`: k, fewer near its max_tokens."""
        return min(self.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1)

    def _draft_candidates(self) -> list[Sequence]:
        """The sequences a draft could go to in this step, if the policy drafts at this
        batch size: room past the next token, and not paused (drafts that kept failing, or
        not coming). A plain step looks at no sequence one by one."""
        if self.drafter is None:
            return []
        decoding = [s for s in self.scheduler.running if s.status == SequenceStatus.RUNNING_DECODE]
        if not self.draft_policy.batch_drafts(len(decoding)):
            return []
        return [s for s in decoding if s.num_output_tokens + 1 < s.max_tokens
                and self.draft_policy.may_draft(s.request_id, s.num_tokens)]

    def _propose_behind(self, seqs: list[Sequence]) -> bool:
        """Drafts for `seqs` without reading back the step in flight (the device looks them
        up once it knows what that step gives them: `_propose`). Not under a grammar, which
        checks drafts against every token before them. (Without `_overlap_verify` no
        verify row is ever in flight here.)"""
        if not self._draft_behind or self._inflight is None:
            return False
        if any(s.request_id in self.constraints for s in seqs if s.num_output_tokens > s.num_resolved):
            return False
        self._propose(seqs)
        return True

    def _propose(self, seqs: list[Sequence]) -> None:
        """Set each sequence's drafts for the coming step, looked up in its known tokens.

        When a row of it is in flight (`_propose_behind`), the next row starts wherever
        that row really ends (on the device). Prompt lookup's drafts then only hold their
        places: the device looks them up again in the text with what that row gave
        (`draft_history`, `ops.lookup_drafts`), so they follow the real text whatever the
        row accepts, and the host's lookup says whether the text repeats here and how
        many to draft. (Sized so, rows verify more tokens than when the host guesses what
        the row in flight gives and looks up after that: docs/PERFORMANCE.md.) Another
        drafter's drafts follow that guess, the row's drafts then the drafter's next
        token as its own, and are rejected as any others where it is wrong.

        A sequence that gets none counts a miss: it pauses like one whose drafts fail,
        since looking costs the host's time."""
        on_device = isinstance(self.drafter, NgramDrafter)
        for seq in seqs:
            known = seq.num_prompt_tokens + seq.num_resolved
            room = self._draft_room(seq)
            behind = seq.num_tokens > known
            if behind and not on_device:
                upto = seq.num_tokens - 1 if seq.pending_drafts else known
                drafts = self.drafter.propose(seq.request_id, seq.prompt_token_ids, seq.token_at, upto, 1 + room,
                                              known=known)[1 : 1 + room]
            else:
                drafts = self.drafter.propose(seq.request_id, seq.prompt_token_ids, seq.token_at, known, room)
                if drafts and behind:
                    seq.draft_history = self.drafter.known_tokens(seq.request_id, known)
                elif drafts and seq.request_id in self.constraints:
                    drafts = self.constraints.check_drafts(seq, drafts)
            if behind and seq.pending_drafts:
                self.draft_policy.stats.num_chained_rows += bool(drafts)
            if not drafts:  # as a verify row that accepts nothing: the step adds one token
                self.draft_policy.on_verified(seq.request_id, 0, 0, seq.num_tokens + 1)
            seq.draft_token_ids = drafts

    def _launch(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, object]:
        step = self.runner.build_step(batch)
        sampling = [s for s, samples in zip(batch.seqs, batch.samples) if samples]
        # A batch without a constrained row takes the plain path; otherwise the masks are
        # built between the forward pass and sampling (see _constrain).
        process = functools.partial(self._constrain, batch, sampling) if self.constraints.any_in(sampling) else None
        drafts = batch.sampling_drafts()
        if self.workers is None:
            handle = self.runner.launch(step, sampling, process, drafts)
        else:
            try:
                self.workers.send_step(step)
                handle = self.runner.launch(step, sampling, process, drafts)
            except Exception as e:
                self._worker_failed(e)
        if process is None:
            self.scheduler.on_launch(batch)
        if self.on_launched is not None:
            self.on_launched()
        return batch, handle

    def _constrain(self, batch: ScheduledBatch, sampling: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Runs inside runner.launch once the forward pass is queued: the step's
        bookkeeping, then (if a grammar row's mask needs it) the previous step read back
        while the device computes this one, then the masks and biases on the logits."""
        self.scheduler.on_launch(batch)
        if self._inflight is not None and self.constraints.needs_previous_tokens(sampling):
            t0 = time.perf_counter()
            self._early_outputs += self._resolve()
            self.constraints.stats.wait_seconds += time.perf_counter() - t0
        return self.constraints.apply(sampling, logits, batch.sampling_drafts())

    def _resolve(self) -> list[RequestOutput]:
        batch, handle = self._inflight
        self._inflight = None
        t_wait = time.perf_counter()
        try:
            result = self.runner.collect(handle)
        except Exception as e:
            if self.workers is None:
                raise
            self._worker_failed(e)
        now = time.perf_counter()
        self.stats.record_step(batch)
        if self.stats.trace is not None:
            self.stats.trace.record(batch, now, blocked_s=now - t_wait)
        outputs = self._postprocess(batch, result)
        if self.drafter is not None:
            self.drafter.after_step(batch, result.drafts)
            self._time_for_policy(batch, now)
        return outputs

    def _time_for_policy(self, batch: ScheduledBatch, now: float) -> None:
        """Give the draft policy a decode step's cost and yield: from the read-back of the
        step before it (or its own launch, if later: the engine was idle) to its own
        read-back, and the tokens it gave. Read-back to read-back is a step's share of the
        pipeline whichever call launched or read it; timing the calls instead put a verify
        step that is read back in a later call (chained) on that call, whose yield and
        kind were another step's: each probe of a rule that had turned drafting off then
        seemed to yield one token a row, and drafting never came back on.

        A drafting step is one that verified drafts, or whose lookup cost it its overlap
        with the step in flight; a step whose lookups all came back empty runs as a plain
        step and is timed as one (a dry text is the pause rule's verdict). Timed as
        one-token drafting steps, these held the rule's yield under what verifying gives
        and its median drafting time between a plain and a verify step's, so the rule
        turned drafting off in stretches where it paid (docs/PERFORMANCE.md)."""
        last, self._last_read_back = self._last_read_back, now
        if batch.num_prompt_rows or last is None:
            return
        self.draft_policy.record_step(len(batch), now - max(last, batch.started_s),
                                      batch.num_draft_tokens > 0 or batch.looked_serially,
                                      len(batch) + sum(batch.accepted))

    def _worker_failed(self, error: Exception):
        """A TP step failed part-way (a worker died or failed, or rank 0's own part of the
        step raised): the ranks are out of step and a live worker may be blocked in a
        collective that will never complete, so the workers get only a short grace to
        leave before they are killed. A dead worker is reported as WorkerError even when
        the collective noticed before the control channel's reader did."""
        failure = self.workers.failure(wait_s=2.0)
        self._stop_workers(timeout_s=1.0)
        if failure is not None:
            raise WorkerError(failure) from error
        raise error

    def _postprocess(self, batch: ScheduledBatch, result: StepOutput) -> list[RequestOutput]:
        if result.prompt_logprobs is not None:
            for seq, lps in zip(batch.seqs, result.prompt_logprobs):
                k = seq.sampling_params.prompt_logprobs or 0
                seq.prompt_logprobs.extend((lp, top[:k], rank) for lp, top, rank in lps)
        now = time.monotonic()
        outputs = []
        if result.input_ids is not None:
            _take_looked_up_drafts(batch, result.input_ids)
        new_tokens = self.scheduler.on_result(batch, result.tokens)
        verify = [(s, len(d)) for s, d in zip(batch.seqs, batch.drafts) if d]
        for (seq, drafted), accepted in zip(verify, batch.accepted):
            self.draft_policy.on_verified(seq.request_id, drafted, accepted, seq.num_tokens)
        for seq, first, row in new_tokens:
            if seq.first_token_time is None:
                seq.first_token_time = now
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            self._take_tokens(req, first, row, result)
            self.stats.generation_tokens += seq.num_resolved - first
            outputs.append(self._output(req))
            if seq.is_finished:
                self._forget(seq.request_id)
        return outputs

    def _take_tokens(self, req: _Request, first: int, row: int, result: StepOutput) -> None:
        """Output tokens `first`.. of `req` (logit rows `row`..): their logprobs, then stop
        strings and grammars, which may end the sequence inside a verify row's run."""
        seq = req.seq
        lp = seq.sampling_params.logprobs
        tokens = seq.output_token_ids[first : seq.num_resolved]
        ended = seq.is_finished  # the scheduler stopped it at its last token (EOS, max_tokens, ...)
        for j, token in enumerate(tokens):
            if lp is not None and result.logprobs is not None:
                top = result.top_logprobs[row + j][:lp] if result.top_logprobs else []
                rank = result.ranks[row + j] if result.ranks is not None else None
                seq.output_logprobs.append((result.logprobs[row + j], top, rank))
            keep = first + j + 1
            if req.text is not None and req.text.add_token(token) is not None:
                self.scheduler.finish(seq, FinishReason.STOP, keep=keep)
                break
            if (not ended or j < len(tokens) - 1) and seq.request_id in self.constraints \
                    and self.constraints.on_token(seq, token):
                self.scheduler.finish(seq, FinishReason.STOP, keep=keep)  # the grammar is complete
                break

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(request_id)
            self.draft_policy.forget(request_id)
        self._penalty_requests.discard(request_id)
        self.constraints.remove(request_id)

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        finished = seq.is_finished
        done = seq.num_resolved
        token_ids = seq.output_token_ids[:done]
        text, delta = req.text.texts(token_ids, finished) if req.text is not None else ("", "")
        new_ids = seq.output_token_ids[req.sent_tokens : done]
        req.sent_tokens = done
        logprobs = req.logprobs
        if logprobs is not None and len(logprobs) < len(seq.output_logprobs):
            logprobs.extend(TokenLogprob(t, lp, top, rank) for t, (lp, top, rank) in
                            zip(seq.output_token_ids[len(logprobs):], seq.output_logprobs[len(logprobs):]))
        stop_reason = None  # like vLLM: None for EOS, else the stop string or stop token
        if seq.finish_reason == FinishReason.STOP:
            last = seq.output_token_ids[done - 1] if done else None
            if req.text is not None and req.text.stopped_by:
                stop_reason = req.text.stopped_by
            elif last in seq.sampling_params.stop_token_ids:
                stop_reason = last
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs(req),
            token_ids=token_ids,
            text=text,
            finished=finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            delta_text=delta,
            delta_token_ids=new_ids,
            error=seq.error,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
            stop_reason=stop_reason,
            arrival_time=seq.arrival_time,
            scheduled_time=seq.scheduled_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
        )

    @staticmethod
    def _prompt_logprobs(req: _Request) -> list[TokenLogprob | None] | None:
        """[None, logprob of prompt token 1 given token 0, ...] once every prompt token has
        one (they arrive chunk by chunk), for a request that asked."""
        seq = req.seq
        if req.prompt_logprobs is None and seq.sampling_params.prompt_logprobs is not None:
            ids = seq.prompt_token_ids
            if len(seq.prompt_logprobs) == len(ids) - 1:
                req.prompt_logprobs = [None] + [
                    TokenLogprob(t, lp, top, rank) for t, (lp, top, rank) in zip(ids[1:], seq.prompt_logprobs)
                ]
        return req.prompt_logprobs

    # ---- whole generations ---------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order (rejected ones carry `error`)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [self.add_request(p, sp).request_id for p, sp in zip(prompts, params_list)]
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        while len(done) < len(ids):
            for out in self.step():
                if out.finished or out.rejected:
                    if out.request_id in wanted and out.request_id not in done:
                        done[out.request_id] = out
                        if bar:
                            bar.update(1)
            if not self.has_unfinished_requests() and len(done) < len(ids):
                raise RuntimeError("engine went idle before every request finished")
        if bar:
            bar.close()
        return [done[i] for i in ids]

    def begin_generation(
        self, prompts: Seq[Prompt], params: SamplingParams | None = None
    ) -> list[str]:
        """Queue prompts to be advanced with step(); read them back with get_generation_outputs()."""
        self._generation_ids = [self.add_request(p, params).request_id for p in prompts]
        self._generation_outputs = {}
        return list(self._generation_ids)

    def get_generation_outputs(self) -> list[str]:
        """Texts of the begin_generation batch (as far as generated)."""
        return [self._generation_outputs[i].text if i in self._generation_outputs else "" for i in self._generation_ids]

    def step_generation(self) -> list[RequestOutput]:
        """step() that also records the outputs of the begin_generation batch."""
        outs = self.step()
        for out in outs:
            if out.request_id in self._generation_ids:
                self._generation_outputs[out.request_id] = out
        return outs

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (bounded); a single-process engine has nothing to stop."""
        self._stop_workers(timeout_s=10.0)

    def _stop_workers(self, timeout_s: float) -> None:
        workers, self.workers = getattr(self, "workers", None), None
        if workers is not None:
            workers.shutdown(timeout_s)


@dataclass
class StepTrace:
    """A timeline of resolved steps, one entry per step in parallel lists (a few appends
    per step; compact as JSON). `blocked_s` is the time the host waited inside
    `runner.collect` for the step's tokens: long means the device was the bottleneck, near
    zero means the device had finished before the host asked (the host was). `period_s`
    is the time since the previous resolve (the first: since the trace began), so the
    periods add up to the traced wall time."""

    origin: float = field(default_factory=time.perf_counter)  # perf_counter when the trace began
    t_s: list[float] = field(default_factory=list)  # resolve time, seconds after origin
    prefill: list[int] = field(default_factory=list)  # 1 for a prefill (or mixed) step
    seqs: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)  # a mixed step's decode rows (else 0)
    blocked_s: list[float] = field(default_factory=list)
    period_s: list[float] = field(default_factory=list)

    COLUMNS = ("t_s", "prefill", "seqs", "tokens", "decode_rows", "blocked_s", "period_s")

    def record(self, batch: ScheduledBatch, now: float, blocked_s: float) -> None:
        t = now - self.origin
        self.period_s.append(t - (self.t_s[-1] if self.t_s else 0.0))
        self.t_s.append(t)
        self.prefill.append(int(batch.is_prefill))
        self.seqs.append(len(batch))
        self.tokens.append(batch.num_tokens)
        self.decode_rows.append(batch.num_decode)
        self.blocked_s.append(blocked_s)

    def columns(self) -> dict[str, list]:
        return {name: getattr(self, name) for name in self.COLUMNS}


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0  # computed prompt tokens (prefix hits excluded)
    generation_tokens: int = 0
    max_decode_batch: int = 0
    last_batch_size: int = 0  # sequences in the latest step
    last_batch_tokens: int = 0
    last_batch_prefill: bool = False
    last_batch_prompts_done: int = 0  # prompts of the latest step that sampled their first token
    trace: StepTrace | None = field(default=None, repr=False)  # between start_trace() and stop_trace()

    def start_trace(self) -> StepTrace:
        """Record every step resolved from now on (off by default)."""
        self.trace = StepTrace()
        return self.trace

    def stop_trace(self) -> StepTrace | None:
        trace, self.trace = self.trace, None
        return trace

    def record_step(self, batch: ScheduledBatch) -> None:
        self.steps += 1
        self.last_batch_size, self.last_batch_tokens, self.last_batch_prefill = len(batch), batch.num_tokens, batch.is_prefill
        decode_seqs = batch.num_decode_seqs
        self.last_batch_prompts_done = sum(batch.samples[decode_seqs:])
        if batch.num_prompt_rows:
            self.prefill_steps += 1
            # A mixed step's decode rows (with their drafts) are not prompt.
            self.prompt_tokens += sum(batch.num_new_tokens[decode_seqs:])
        else:
            self.decode_steps += 1
            self.max_decode_batch = max(self.max_decode_batch, len(batch))


def _take_looked_up_drafts(batch: ScheduledBatch, input_ids: list[int]) -> None:
    """The drafts the device looked up for the batch's rows drafted behind a row in flight,
    read off the step's input ids (a decode step: each sequence's row is its last token
    then its drafts, in batch order), in place of those that held their places."""
    at = 0
    for i, (n, history) in enumerate(zip(batch.num_new_tokens, batch.draft_histories)):
        if history is not None:
            batch.drafts[i] = input_ids[at + 1 : at + n]
        at += n

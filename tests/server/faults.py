"""Engines that fail on purpose, built inside an engine-core process by `CoreProcess.start(
..., engine_factory=functools.partial(failing_engine, ...))` (a module-level function, so it
pickles by reference)."""

from __future__ import annotations

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine

SECRET = "secret-internal-detail-4711"


def failing_engine(config: EngineConfig, fail_at: dict[tuple[int, ...], int], break_abort: bool = False) -> LLMEngine:
    """An engine whose step raises, once per request, when a request whose prompt starts
    with one of `fail_at`'s token-id prefixes has that many output tokens; with
    `break_abort`, aborting a request raises too (the engine cannot be cleaned up)."""
    engine = LLMEngine(config, detokenize=False)
    real_step = engine.step
    fired: set[str] = set()

    def step():
        for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
            for prefix, after in fail_at.items():
                if (tuple(seq.prompt_token_ids[:len(prefix)]) == prefix and seq.num_resolved >= after
                        and seq.request_id not in fired):
                    fired.add(seq.request_id)
                    raise RuntimeError(f"CUDA went sideways: {SECRET}")
        return real_step()

    def broken_abort(request_id):
        raise RuntimeError(SECRET)

    engine.step = step
    if break_abort:
        engine.abort = broken_abort
    return engine

"""Test helper: see which batches an engine's scheduler hands out."""

from __future__ import annotations

from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.scheduler import ScheduledBatch


def record_batches(eng: LLMEngine) -> list[ScheduledBatch]:
    """Wrap `eng.scheduler.schedule` so that every batch it returns is also appended to
    the returned list (in order); `del eng.scheduler.schedule` undoes it."""
    batches: list[ScheduledBatch] = []
    schedule = eng.scheduler.schedule

    def recording_schedule() -> ScheduledBatch | None:
        batch = schedule()
        if batch is not None:
            batches.append(batch)
        return batch

    eng.scheduler.schedule = recording_schedule
    return batches

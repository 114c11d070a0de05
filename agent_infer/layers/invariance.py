"""The batch-invariant mode's switch (EngineConfig.batch_invariant), one per model, shared
by its projections and its LM head and set by the engine before each step: in a decode
or verify step, projections of up to `max_rows` rows compute each row exactly as a step
of that row alone would (ops.linear's `invariant_rows`: on a GPU one GEMM whose tiles do
not depend on the row count, for one row too); in a prefill step they run as
usual, since the scheduler gives such a step one prompt (its rows are then those of the
prompt alone) and the row-by-row path would re-read the weights once per prompt token."""

from __future__ import annotations


class RowInvariance:
    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.rows = 0  # what the projections see now: max_rows while a decode step runs

    def decoding(self, on: bool) -> None:
        self.rows = self.max_rows if on else 0


def invariant_rows(invariance: RowInvariance | None) -> int:
    """The `invariant_rows` a projection passes to ops.linear: 0 when the mode is off."""
    return invariance.rows if invariance is not None else 0

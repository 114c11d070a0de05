"""Drafts from the checkpoint's multi-token-prediction layer (DeepSeek-V3's).

The MTP layer runs over every row of each step, right after its sampler, with the
step's own attention metadata (and, for a decode step, a CUDA graph beside the step's):
row p gets the token sampled there, or the prompt's next token where p does not sample.
That writes its own K/V for them, and at a sequence's last position that stands (a verify
row's last accepted one) it predicts the token after the next one, the draft for the
coming step, read back with the step's tokens. The drafts are known only once the step
is read back, so steps resolve one at a time with MTP (no overlap of the next launch with
this read-back).
"""

from __future__ import annotations


class MtpDrafter:
    def __init__(self, runner):
        self.runner = runner
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request -> (its token count, drafts)

    def after_step(self, batch, row_drafts: list[int] | None) -> None:
        for seq, token in self.runner.draft_with_mtp(batch, row_drafts):
            self._drafts[seq.request_id] = (seq.num_tokens, [token])

    def propose(self, request_id: str, prompt: list[int], tokens_at, total: int, k: int,
                known: int | None = None) -> list[int]:
        held = self._drafts.pop(request_id, None)
        if held is None or held[0] != total:
            return []
        return held[1][:k]

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)

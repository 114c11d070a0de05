"""Drafts from the checkpoint's multi-token-prediction layer (DeepSeek-V3's).

The MTP layer runs over the positions each step computed and kept (prompt chunks,
decode rows, a verify row's accepted run): that writes its own K/V for them, and at a
sequence's last position it predicts the token after the next one, the draft for the
coming step. A decode step runs it on the device right after its sampler, over all its
rows, with the step's own attention metadata (and CUDA graph), each row given the token
sampled there; the read-back then keeps each sequence's last accepted row. A step with
prompt rows runs it once read back, over the rows kept. Either way a step's drafts are
known only once it is read back, so steps resolve one at a time with MTP (no overlap of
the next launch with this read-back).
"""

from __future__ import annotations


class MtpDrafter:
    def __init__(self, runner):
        self.runner = runner
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request -> (its token count, drafts)

    def after_step(self, batch, row_drafts: list[int] | None) -> None:
        for seq, token in self.runner.draft_with_mtp(batch, row_drafts):
            self._drafts[seq.request_id] = (seq.num_tokens, [token])

    def propose(self, request_id: str, prompt: list[int], tokens_at, total: int, k: int) -> list[int]:
        known = self._drafts.pop(request_id, None)
        if known is None or known[0] != total:
            return []
        return known[1][:k]

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)

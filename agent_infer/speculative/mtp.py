"""Drafts from the checkpoint's multi-token-prediction layer (DeepSeek-V3's).

After every step, once its tokens are known, the MTP layer runs over the positions the
step computed and kept (prompt chunks, decode rows, a verify row's accepted run): that
writes its own K/V for them, and at a sequence's last position it predicts the token
after the next one, the draft for the coming step. Steps therefore resolve one at a time
with MTP (no overlap of the next launch with this read-back).
"""

from __future__ import annotations


class MtpDrafter:
    def __init__(self, runner):
        self.runner = runner
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request -> (its token count, drafts)

    def after_step(self, batch) -> None:
        for seq, token in self.runner.draft_with_mtp(batch):
            self._drafts[seq.request_id] = (seq.num_tokens, [token])

    def propose(self, request_id: str, prompt: list[int], tokens_at, total: int, k: int) -> list[int]:
        known = self._drafts.pop(request_id, None)
        if known is None or known[0] != total:
            return []
        return known[1][:k]

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)

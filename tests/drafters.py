"""Drafters for tests of the verify machinery, whatever a random model writes."""

from __future__ import annotations


class Replay:
    """Drafts from a reference run's outputs (every `every`-th proposal's last draft
    wrong, or its draft `wrong_at` where there is one), so that acceptance and rejection
    both happen."""

    def __init__(self, outs, wrong_at: int = -1, every: int = 3):
        self.outs, self.calls, self.wrong_at, self.every = outs, 0, wrong_at, every

    def propose(self, request_id, prompt, tokens_at, total, k, known=None):
        out = next(o.token_ids for o in self.outs if o.prompt_token_ids == prompt)
        drafts = list(out[total - len(prompt): total - len(prompt) + k])
        self.calls += 1
        if drafts and self.calls % self.every == 0:
            i = self.wrong_at if -len(drafts) <= self.wrong_at < len(drafts) else -1
            drafts[i] = (drafts[i] + 1) % 100
        return drafts

    def after_step(self, batch, row_drafts):
        pass

    def forget(self, request_id):
        pass

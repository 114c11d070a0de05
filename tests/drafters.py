"""Drafters for tests of the verify machinery, whatever a random model writes."""

from __future__ import annotations


class Replay:
    """Drafts from a reference run's outputs (every third proposal's last draft wrong), so
    that acceptance and rejection both happen."""

    def __init__(self, outs):
        self.outs, self.calls = outs, 0

    def propose(self, request_id, prompt, tokens_at, total, k):
        out = next(o.token_ids for o in self.outs if o.prompt_token_ids == prompt)
        drafts = list(out[total - len(prompt): total - len(prompt) + k])
        self.calls += 1
        if drafts and self.calls % 3 == 0:
            drafts[-1] = (drafts[-1] + 1) % 100
        return drafts

    def after_step(self, batch):
        pass

    def forget(self, request_id):
        pass

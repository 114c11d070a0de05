"""One loader for every model: each checkpoint tensor goes to the parameter the model's
weight map names, through that parameter's `weight_loader`.

A model keeps only its map (`WeightMap`): renames applied first (e.g. a multimodal
checkpoint's language-model prefix), names that load nowhere, and rules that send names
to merged or stacked parameters, all as regular expressions matched against the whole
name (never substrings: `.gate_proj.` must not also catch `mlp.experts.7.gate_proj`).
A name no rule matches loads into the parameter of the same name.

Every parameter loader takes `(param, loaded, shard_id=None, expert_id=None)` and copies
in the part of `loaded` this rank owns; `loaded` may be a lazy handle (loader/weights.py),
so a tensor, or an expert, the rank does not own is never read. A parameter built from
several checkpoint tensors says which in `expected_pieces` ((shard, expert) pairs); the
loader fails when any piece of any parameter is missing, since a weight left at its
initial value is a silent accuracy bug.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from agent_infer.loader.weights import Weight, copy_into, materialize


@dataclass(frozen=True)
class WeightRule:
    """Checkpoint names matching `pattern` load into `target`, a str.format template over
    the pattern's named groups. A group named `shard` gives the shard id (looked up in
    `shards` when given, else its text); a group named `expert` gives the expert id."""

    pattern: str
    target: str
    shards: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class WeightMap:
    rules: tuple[WeightRule, ...] = ()
    skip: tuple[str, ...] = ()  # names that load into nothing
    renames: tuple[tuple[str, str], ...] = ()  # (pattern, replacement), applied in order first
    _compiled: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _re(self, pattern: str) -> re.Pattern:
        compiled = self._compiled.get(pattern)
        if compiled is None:
            compiled = self._compiled[pattern] = re.compile(pattern)
        return compiled

    def resolve(self, name: str) -> tuple[str, Any, int | None] | None:
        """(parameter name, shard id, expert id) for a checkpoint name; None: skip it."""
        for pattern, replacement in self.renames:
            name = self._re(pattern).sub(replacement, name)
        if any(self._re(p).fullmatch(name) for p in self.skip):
            return None
        for rule in self.rules:
            m = self._re(rule.pattern).fullmatch(name)
            if m is None:
                continue
            groups = m.groupdict()
            shard = groups.get("shard")
            if shard is not None and rule.shards is not None:
                shard = rule.shards[shard]
            expert = groups.get("expert")
            return rule.target.format(**groups), shard, None if expert is None else int(expert)
        return name, None, None


def default_weight_loader(param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
    copy_into(param, materialize(loaded))


def load_model(model: nn.Module, weights: Iterable[tuple[str, Weight]], weight_map: WeightMap) -> None:
    params = dict(model.named_parameters())
    # Buffers a checkpoint may fill (an attention layer's KV-cache scales) carry a loader.
    params |= {n: b for n, b in model.named_buffers() if hasattr(b, "weight_loader")}
    seen: dict[str, set] = defaultdict(set)
    for name, w in weights:
        where = weight_map.resolve(name)
        if where is None:
            continue
        target, shard, expert = where
        param = params.get(target)
        if param is None:
            via = f" (mapped to {target})" if target != name else ""
            raise KeyError(f"checkpoint weight {name}{via} matches no parameter of {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, w, shard_id=shard, expert_id=expert)
        except ValueError as e:
            raise ValueError(f"checkpoint weight {name}: {e}") from None
        seen[target].add((shard, expert))
    missing = sorted(n for n, p in params.items() if not getattr(p, "expected_pieces", {(None, None)}) <= seen[n])
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise ValueError(f"checkpoint lacks {len(missing)} weights the model needs: {shown}")

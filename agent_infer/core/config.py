"""The engine core's own settings, beside the engine's (`EngineConfig`); no torch, so a
front end or the supervisor can build and check them before any model loads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreConfig:
    # Requests accepted but not yet admitted by the scheduler, over every front end;
    # beyond it a group is refused (the front end answers 503 + Retry-After).
    max_waiting: int = 1024

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")

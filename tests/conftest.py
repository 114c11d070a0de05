"""Shared fixtures: the real default model, and tiny random checkpoints written by
transformers' own model classes (odd shapes on purpose)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

from tests.tiny_models import TINY_SPECS, write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from agent_infer.loader.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny_model(name, str(root / name)) for name in TINY_SPECS}


@pytest.fixture(scope="session")
def smol_engine(default_model_dir):
    """One fp32 CPU engine on the default model, shared by tests that only read from it."""
    from agent_infer.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", num_kv_blocks=2048))


def pytest_collection_finish(session) -> None:
    """Start the Triton interpreter checks (a child pytest, minutes of one core) as soon
    as they are known to be selected, so they run beside the rest of the suite."""
    from tests import test_triton_interpreter as interpreter

    if not interpreter.IN_CHILD and any(item.name == interpreter.TEST_NAME for item in session.items):
        interpreter.start_child()


def pytest_sessionfinish(session, exitstatus) -> None:
    """A session cut short (Ctrl-C, -x) leaves no interpreter child behind."""
    from tests import test_triton_interpreter as interpreter

    if not interpreter.IN_CHILD:
        interpreter.stop_child()

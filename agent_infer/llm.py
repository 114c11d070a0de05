"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import fields
from typing import Sequence as Seq

from agent_infer.config import EngineConfig
from agent_infer.engine.launch import launch_engine
from agent_infer.engine.llm_engine import Prompt
from agent_infer.engine.outputs import RequestOutput
from agent_infer.loader.default_model import ensure_default_model
from agent_infer.loader.tokenizer import ChatFormatter
from agent_infer.sampling_params import SamplingParams


class LLM:
    """An engine with a simple batch API. `model=None` uses the embedded default model.
    Keyword arguments are EngineConfig fields (dtype, device, max_num_seqs, ...)."""

    def __init__(self, model: str | None = None, **engine_kwargs):
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine options: {', '.join(unknown)}")
        self.config = EngineConfig(model=model or ensure_default_model(), **engine_kwargs)
        self.engine = launch_engine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        return self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        **template_kwargs,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        fmt = ChatFormatter(self.tokenizer)
        # The template already carries any BOS: encode without adding special tokens again.
        prompts = [self.tokenizer.encode(fmt.render(c, **template_kwargs), add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

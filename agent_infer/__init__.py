"""agent-infer: a lean, fast LLM inference engine."""

from agent_infer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; keep `import agent_infer` light for the CLI.
    if name == "LLM":
        from agent_infer.llm import LLM

        return LLM
    raise AttributeError(name)

"""agent-infer: a lean, fast LLM inference engine."""

from agent_infer.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; keep `import agent_infer` light for the CLI.
    if name == "LLM":
        from agent_infer.llm import LLM

        return LLM
    raise AttributeError(name)

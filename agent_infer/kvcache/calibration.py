"""KV-cache scales computed at start-up (`--calculate-kv-scales`), for an fp8 cache whose
checkpoint brings none.

An fp8 (e4m3) cache holds K / k_scale and V / v_scale per layer. With a scale of 1, keys
or values past +-448 saturate and small ones lose precision near e4m3's subnormals. The
engine runs one prefill of a fixed text through the model with a throwaway cache in the
model's dtype, reads back the largest |K| and |V| each layer stored (after its norms and
RoPE, as the fp8 cache would get them), and sets k_scale = max|K| / 200 and v_scale =
max|V| / 100: the calibration's largest values land at 200 and 100 of e4m3's 448, the
headroom vLLM's `--calculate-kv-scales` leaves (its K_SCALE_CONSTANT and V_SCALE_CONSTANT)
for inputs that run larger than the calibration's. Under tensor parallelism the ranks
take the maximum over all of them, so every rank's layer has one scale.

The text is encoded with the model's tokenizer; a checkpoint without one is calibrated on
a fixed spread of token ids instead (the engine logs which).
"""

from __future__ import annotations

import logging

from agent_infer.config import ConfigError

log = logging.getLogger(__name__)

# Where the calibration's largest |K| and |V| land in e4m3's range (+-448).
K_TARGET, V_TARGET = 200.0, 100.0
MAX_CALIBRATION_TOKENS = 512

# Prose, code, numbers and a chat-like exchange: the kinds of text an agent server sees.
CALIBRATION_TEXT = """\
The engine keeps every running request's keys and values in a paged cache, one block of
sixteen tokens at a time, and shares the blocks of a common prefix between requests.
When memory runs short it stops admitting new prompts rather than evicting work in flight.

def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda x: x[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged

User: What is the boiling point of water at 2,000 metres, and why is it lower?
Assistant: About 93.4 degrees Celsius. Air pressure falls with altitude (to roughly 79.5
kPa at 2,000 m), and water boils once its vapour pressure equals the pressure around it.

{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius", "days": 3}}
| quarter | revenue (M EUR) | margin |
| Q1 2025 | 1,204.7 | 18.2 % |
| Q2 2025 | 1,311.9 | 19.6 % |
Les chercheurs ont publié leurs résultats en mars; 研究者たちは三月に結果を発表した。
"""


def calibration_ids(tokenizer, vocab_size: int, limit: int) -> list[int]:
    """The calibration text's token ids (at most `limit`), or, with no tokenizer, a fixed
    spread over the vocabulary. A tokenizer whose ids run past the model's vocabulary is
    not the model's: refused."""
    if tokenizer is None:
        log.info("--calculate-kv-scales: the checkpoint has no tokenizer; calibrating on a fixed spread of token ids")
        return [(7919 * i + 11) % vocab_size for i in range(min(limit, MAX_CALIBRATION_TOKENS))]
    ids = list(tokenizer(CALIBRATION_TEXT, add_special_tokens=True)["input_ids"])[: min(limit, MAX_CALIBRATION_TOKENS)]
    if max(ids) >= vocab_size:
        raise ConfigError(f"the tokenizer gives token id {max(ids)} for a model of {vocab_size} tokens; "
                          f"--calculate-kv-scales needs the model's own tokenizer")
    return ids


def scale_from_amax(amax: float, target: float) -> float:
    """The scale that puts a calibration's largest stored |value| `amax` at `target`; 1
    for a part that stored only zeros."""
    return amax / target if amax > 0 else 1.0


def scales_from_amax(k_amax: float, v_amax: float) -> tuple[float, float]:
    """(k_scale, v_scale) for a layer whose calibration stored at most |K| = k_amax and
    |V| = v_amax."""
    return scale_from_amax(k_amax, K_TARGET), scale_from_amax(v_amax, V_TARGET)

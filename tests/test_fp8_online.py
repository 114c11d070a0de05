"""`--quantization fp8` (`LLM(..., quantization="fp8")`): a full-precision checkpoint's
projections quantized as they load, e4m3 with one scale per output row. On the default
model the demo's answer stays the same and the perplexity of a fixed English text moves
by less than 3 %; a quantized layer holds exactly the values quantize-then-dequantize
gives. A tensor-parallel size that would split an fp8 checkpoint's blocks is refused,
naming the weight."""

from __future__ import annotations

import math

import pytest
import torch

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.layers.linear import LinearBase
from agent_infer.layers.moe import RoutedExperts
from agent_infer.llm import LLM
from agent_infer.quantization import fp8 as F
from agent_infer.sampling_params import SamplingParams
from tests.test_fp8_checkpoints import _quantized_pair
from tests.tiny_models import write_tiny_model

# The demo's question (Makefile: make demo) and its settings (greedy, up to 256 tokens).
DEMO = [{"role": "user", "content": "What is the capital of France?"}]
DEMO_PARAMS = SamplingParams(temperature=0.0, max_tokens=256)
# A fixed English text for perplexity, three paragraphs of plain prose written for this
# test (about 420 tokens: a single paragraph's perplexity moves by a few per cent with
# which of its tokens a rounding happens to flip).
TEXTS = (
    "The library on the corner of the square opens at nine every morning, and by ten most of its tables are taken. "
    "Students come to read before their lectures, retired teachers come for the newspapers, and a few regulars bring "
    "their own lamps because they say the ceiling lights are too harsh. The librarian knows almost everyone by name. "
    "She keeps a list of books that people ask for but the library does not have, and once a month she sends it to "
    "the city council with a short letter explaining why each title would be useful. Some months the council buys "
    "nothing at all; other months a box arrives with twenty new books, and the regulars gather around the front desk "
    "to see what came. Last winter the heating failed for a week. Instead of closing, the librarian handed out "
    "blankets and moved the reading tables closer to the windows, where the sun warmed the room in the afternoon.",
    "Building a small boat by hand takes most people a full summer. The hull is shaped first, plank by plank, each "
    "one steamed until it bends and then clamped to the frame while it cools. Builders argue about glue and screws, "
    "about which wood lasts longest in salt water, and about whether a boat should be painted or oiled. The first "
    "launch is always a nervous moment: friends stand on the dock, someone opens a bottle, and everyone watches to "
    "see whether the water stays outside. Usually it does, although a slow leak in the first week is common while "
    "the wood swells.",
    "When the train was delayed for the third time that week, the passengers on the platform began to talk to one "
    "another. A nurse coming off a night shift explained that she had started keeping a book in her bag for exactly "
    "this reason. A boy with a violin case said his lesson would start without him. An older man, who had taken the "
    "same train for forty years, told them that the line had been just as unreliable when he was young, and that the "
    "station had once had a cafe where the waiting room is now. By the time the train arrived they had agreed to "
    "meet there again, and some of them actually did.",
)


@pytest.fixture(scope="module")
def fp8_llm(default_model_dir):
    llm = LLM(default_model_dir, device="cpu", dtype="float32", quantization="fp8", num_kv_blocks=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def full_llm(default_model_dir):
    llm = LLM(default_model_dir, device="cpu", dtype="float32", num_kv_blocks=1024)
    yield llm
    llm.shutdown()


def _perplexity(llm: LLM) -> float:
    prompts = [llm.tokenizer.encode(text) for text in TEXTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [p.logprob for out in outs for p in out.prompt_logprobs[1:]]
    assert len(logprobs) == sum(len(ids) - 1 for ids in prompts) > 400
    return math.exp(-sum(logprobs) / len(logprobs))


def test_the_demo_answer_is_unchanged(fp8_llm, full_llm):
    ours = fp8_llm.chat(DEMO, DEMO_PARAMS, use_tqdm=False)[0]
    full = full_llm.chat(DEMO, DEMO_PARAMS, use_tqdm=False)[0]
    assert "Paris" in full.text
    assert ours.text == full.text


def test_perplexity_within_three_percent(fp8_llm, full_llm):
    """Against the fp32 model on CPU (its weights rounded to bf16 give the same perplexity
    to 0.1 %, so this is the bf16 baseline too)."""
    fp8, full = _perplexity(fp8_llm), _perplexity(full_llm)
    print(f"perplexity: full precision {full:.3f}, fp8 weights {fp8:.3f} ({100 * (fp8 / full - 1):+.2f} %)")
    assert abs(fp8 / full - 1) < 0.03, (fp8, full)
    assert fp8 != full  # the weights did change


def test_every_projection_holds_its_quantized_values(default_model_dir, fp8_llm, full_llm):
    """Each projection of the quantized model equals quantize-then-dequantize of the
    full-precision one, row by row; embeddings (and the tied head) are untouched."""
    ours = dict(fp8_llm.engine.runner.model.named_modules())
    linears = [(n, m) for n, m in full_llm.engine.runner.model.named_modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * 30  # qkv, o, gate_up, down in each of the 30 layers
    for name, layer in linears:
        q, scale = F.quantize_channel(layer.weight.data)
        torch.testing.assert_close(ours[name].weight.data, F.dequantize_channel(q, scale), rtol=0, atol=0)
    torch.testing.assert_close(fp8_llm.engine.runner.model.model.embed_tokens.weight,
                               full_llm.engine.runner.model.model.embed_tokens.weight, rtol=0, atol=0)


def test_an_unknown_quantization_is_refused(default_model_dir):
    with pytest.raises(ConfigError, match="quantization must be 'fp8'"):
        EngineConfig(model=default_model_dir, quantization="int4")


def test_a_size_that_splits_a_block_is_refused_by_name(tmp_path):
    """Blocks of 32 x 8 on the tiny Qwen3 (intermediate size 160 = 5 blocks of rows):
    TP 2 would give each rank 80 rows, two and a half blocks. Loading stops naming the
    weight and the split."""
    src = write_tiny_model("qwen3", str(tmp_path / "src"))
    fp8_dir, ref_dir = str(tmp_path / "fp8"), str(tmp_path / "ref")
    from tests import test_fp8_checkpoints as T

    saved = T.BLOCK
    T.BLOCK = (32, 8)
    try:
        _quantized_pair(src, fp8_dir, ref_dir, "block")
    finally:
        T.BLOCK = saved
    one = LLMEngine(EngineConfig(model=fp8_dir, device="cpu", dtype="float32", num_kv_blocks=64))
    assert one.runner.model is not None  # whole weights: every block is whole
    with pytest.raises(Exception, match=r"mlp\.gate_proj\.weight.*rows 0\.\.80 .*would split its 32 x 8 blocks"):
        LLMEngine(EngineConfig(model=fp8_dir, device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2))


@pytest.mark.parametrize("family", ["qwen3", "deepseek-v3"])
def test_quantized_on_load_splits_over_two_ranks_as_over_one(tmp_path, family):
    """Per-row scales split with their rows, so any tensor-parallel size that splits the
    model splits its fp8 form: TP 2 gives TP 1's tokens (MLA's kv_b_proj, absorbed into
    the attention, stays in full precision). The routed and shared experts are quantized
    per row too, each down projection's row over the whole intermediate dimension."""
    from tests.test_fp8_checkpoints import _deepseek_v3

    path = (write_tiny_model("qwen3", str(tmp_path / "m")) if family == "qwen3" else _deepseek_v3(str(tmp_path / "m")))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [[5, 9, 13, 200, 7], list(range(3, 40))]
    one = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, quantization="fp8",
                                 async_scheduling=False))
    full = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64))
    quantized = [n for n, m in one.runner.model.named_modules() if isinstance(m, LinearBase)]
    assert quantized and all(torch.equal(dict(one.runner.model.named_modules())[n].weight,
                                         dict(full.runner.model.named_modules())[n].weight) == n.endswith("kv_b_proj")
                             for n in quantized)
    for name, m in full.runner.model.named_modules():
        if isinstance(m, RoutedExperts):
            ours = dict(one.runner.model.named_modules())[name]
            for w in ("w13", "w2"):
                full_w = getattr(m, w).data
                q, scale = F.quantize_channel(full_w.reshape(-1, full_w.shape[-1]))
                want = F.dequantize_channel(q, scale).view(full_w.shape)
                if w == "w2" and m.num_shared > 1:  # the shared experts' rows span all their columns
                    want = want[: m.num_local]
                    full_w = full_w[: m.num_local]
                got = getattr(ours, w).data[: want.shape[0]]
                torch.testing.assert_close(got, want, rtol=0, atol=0)
                assert not torch.equal(got, full_w)
    ref = one.generate(prompts, params)
    two = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, quantization="fp8",
                                 tensor_parallel_size=2))
    try:
        got = two.generate(prompts, params)
    finally:
        two.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]

"""After start-up, no serving step compiles a Triton kernel variant (CPU guard).

A variant compiled while serving stalls its step by one to two seconds on an H200; the
first batch of nano-vllm's workload once paid ~2.5 s that way (the placeholder fill had
a block size per decode batch). The engine compiles at start-up what a step can need:
the decode graphs are captured for every graph batch size, and the warm-up's requests
run the rest (engine/warmup.py). This test checks that promise where the kernels cannot
run: the engine's own scheduler produces the steps, first the warm-up's, then those of a
nano-vllm-like workload, and each step is replayed with every Triton kernel replaced by
a recorder of the variant it would compile (tests/kernel_variants.py) — prefill steps
through the whole forward pass and the sampler, decode steps through what runs outside
the captured graphs (input staging and placeholder fill) and the sampler. Every variant
of the workload must be one of the warm-up's. tests/gpu/test_no_compile_after_startup.py
checks the same on a GPU with Triton's own compile hook.
"""

from __future__ import annotations

import dataclasses
import random
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from agent_infer.config import EngineConfig, ModelConfig
from agent_infer.distributed.state import SINGLE
from agent_infer.engine.cuda_graphs import DecodeGraphs
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.model_runner import ModelRunner
from agent_infer.engine.sampler import Sampler, SamplingBatch
from agent_infer.engine.warmup import warm_up
from agent_infer.sampling_params import SamplingParams
from tests.kernel_variants import VariantRecorder, dispatch_to_triton

pytest.importorskip("triton")

# Steps come from a tiny model (the scheduler's choices do not depend on the weights); they
# are replayed on one layer of a served model's dimensions, since launch choices depend on
# them (row blocks by hidden size, head groups by head counts), in bfloat16 as on a GPU:
# Qwen3-8B's, and the tiny Qwen3 the GPU test serves (small rows packed many per program).
# The vocabulary is small: it fixes the sampling kernels' shape once per model.
TINY = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)
REAL = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=1, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    # tests/tiny_models.py's qwen3, which tests/gpu/test_no_compile_after_startup.py serves.
    "tiny-qwen3": dict(hidden_size=96, intermediate_size=160, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=64),
}
COMMON = dict(vocab_size=503, max_position_embeddings=2304, tie_word_embeddings=False)


def _write(path: str, dims: dict, dtype: torch.dtype) -> str:
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**dims, **COMMON, torch_dtype=str(dtype)[6:]))
    model.to(dtype).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("variants")
    dirs = {name: _write(str(root / name), dims, torch.bfloat16) for name, dims in REAL.items()}
    return {"tiny": _write(str(root / "tiny"), TINY, torch.float32), **dirs}


class StepLog:
    """Every step the engine launches, with the sampling settings of its sampling rows."""

    def __init__(self, engine: LLMEngine):
        self.steps: list[tuple] = []
        launch = engine.runner.launch

        def recording_launch(step, sampling_seqs, *args, **kwargs):
            self.steps.append((step, [s.sampling_params for s in sampling_seqs], [s.seed for s in sampling_seqs]))
            return launch(step, sampling_seqs, *args, **kwargs)

        engine.runner.launch = recording_launch

    def take(self) -> list[tuple]:
        steps, self.steps = self.steps, []
        return steps


def _workload(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's prompt lengths (100-1024), short outputs; mostly temperature 0.6 as there,
    some greedy and some top-p rows as a server sees."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 502) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    params = []
    for i in range(n):
        kw = {"temperature": 0.0} if i % 3 == 0 else {"temperature": 0.6, "top_p": 0.9 if i % 5 == 0 else 1.0}
        params.append(SamplingParams(max_tokens=rng.randint(8, 40), ignore_eos=True, seed=i, **kw))
    return prompts, params


def _replay(runner: ModelRunner, graphs: DecodeGraphs | None, steps: list[tuple], vocab: int) -> None:
    """Run each step's launches as a GPU engine would, under the recorder: prefill steps
    (and, without graphs, decode steps) through the forward pass, decode steps with graphs
    through what runs outside them."""
    from agent_infer.engine.structs import Sequence

    prev_rows = 0
    for step, params, seeds in steps:
        runner._prev_tokens = torch.zeros(max(prev_rows, 1), dtype=torch.int64)
        if step.is_prefill or graphs is None:
            if step.prev_index is not None:  # the stand-in fill leaves placeholder ids: make them real ones
                step = dataclasses.replace(step, input_ids=np.where(step.prev_index >= 0, 0, step.input_ids))
            logits, _ = runner.execute(step)
        else:
            size = graphs.stage(step, runner._prev_tokens)
            logits = torch.empty(size, vocab, dtype=runner.dtype)[: len(step.input_ids)]
        if params:
            seqs = [Sequence(request_id=str(i), prompt_token_ids=[0], sampling_params=p, max_tokens=1, seed=s)
                    for i, (p, s) in enumerate(zip(params, seeds))]
            Sampler()(logits, SamplingBatch.from_seqs(seqs, vocab, logits.device))
        prev_rows = len(step.sample_indices)


@contextmanager
def _no_matmuls():
    """F.linear returns an uninitialised result of the right shape: the replay counts
    kernel variants, and the real-size GEMMs would take minutes on a CPU."""
    import torch.nn.functional as F

    def linear(x, weight, bias=None):
        return torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "linear", linear)
        yield


def _assert_serving_adds_no_variant(runner: ModelRunner, warm_steps: list[tuple], serve_steps: list[tuple],
                                    vocab: int) -> set:
    """Replay the warm-up's steps, then the serving steps, on the GPU-side runner; fail if
    serving launched a kernel variant the warm-up did not. Returns the warm-up's variants."""
    with torch.inference_mode(), dispatch_to_triton(), _no_matmuls():
        with VariantRecorder().active() as at_start:
            _replay(runner, runner.graphs, warm_steps, vocab)
        with VariantRecorder().active() as serving:
            _replay(runner, runner.graphs, serve_steps, vocab)
    new = serving.variants - at_start.variants
    assert not new, f"{len(new)} kernel variants first compiled while serving:\n" + "\n".join(
        f"{name} {spec} {opts}" for name, spec, opts in sorted(new))
    return at_start.variants


MODES = {"graphs": dict(), "eager": dict(enforce_eager=True), "mixed": dict(mixed_batches=True),
         # Eager steps of the batch-invariant mode: the GEMV's row grid, the one-row split plan.
         "invariant": dict(enforce_eager=True, batch_invariant=True)}


@pytest.mark.parametrize("shape", list(REAL))
@pytest.mark.parametrize("mode", list(MODES))
def test_serving_compiles_no_variant_the_start_up_did_not(model_dirs, mode, shape, monkeypatch):
    from agent_infer.attention.dense_triton import DenseTritonBackend
    from agent_infer.engine import model_runner

    options = MODES[mode]
    # The GPU-side runner the steps are replayed on: real dimensions, the Triton backend,
    # decode graphs unless eager (built, not captured: only their input staging runs).
    config = EngineConfig(model=model_dirs[shape], device="cpu", dtype="bfloat16", warmup=False, **options)
    real = ModelConfig.from_hf(config.model)
    with monkeypatch.context() as mp:
        mp.setattr(model_runner, "backend_class", lambda layout, device, name: DenseTritonBackend)
        runner = ModelRunner(real, config, torch.device("cpu"), torch.bfloat16, 2304, SINGLE)
    runner.init_kv_cache(6144)
    if mode != "eager":
        runner.graphs = DecodeGraphs(runner.model, config.max_num_seqs, -(-2304 // config.block_size),
                                     runner.device, runner.backend)

    # The steps: a tiny model's engine, whose warm-up asks the GPU-side runner which eager
    # decode steps it needs.
    engine = LLMEngine(EngineConfig(model=model_dirs["tiny"], device="cpu", dtype="float32", num_kv_blocks=6144,
                                    warmup=False, **options))
    engine.runner.eager_decode_batches = runner.eager_decode_batches
    log = StepLog(engine)
    warm_up(engine)
    warm_steps = log.take()
    prompts, params = _workload(96)
    engine.generate(prompts, params)
    # Steps of two rows, which take the few-row GEMV: a two-token prompt, and two
    # one-token prompts prefilled together (the LM head over both; one at a time in the
    # batch-invariant mode).
    two = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate([[5, 6]], [two])
    engine.generate([[7], [8]], [two, two])
    serve_steps = log.take()
    assert max(len(s.input_ids) for s, _, _ in serve_steps if not s.is_prefill) == 96
    # Prefill steps of many prompts; in the batch-invariant mode one prompt a step (up to 1,024 tokens).
    longest = 1024 if options.get("batch_invariant") else 8192
    assert longest // 2 < max(len(s.input_ids) for s, _, _ in serve_steps if s.is_prefill) <= longest

    at_start = _assert_serving_adds_no_variant(runner, warm_steps, serve_steps, real.vocab_size)
    assert at_start, "the replay recorded no launch"


def test_deepseek_serving_compiles_no_variant_the_start_up_did_not(tmp_path, monkeypatch):
    """The same for DeepSeek (MLA kernels, the fused MoE's alignment and grouped GEMMs,
    whose tiles follow the step's token count), on a tiny V3 whose context (512) is
    shorter than the step budget: its warm-up fills budget-sized steps with several prompts."""
    from agent_infer.attention.mla import LatentTritonBackend
    from agent_infer.engine import model_runner
    from tests.deepseek_models import VOCAB as DS_VOCAB
    from tests.deepseek_models import write_deepseek_model

    path = write_deepseek_model("v3", str(tmp_path / "v3"))
    config = EngineConfig(model=path, device="cpu", dtype="bfloat16", warmup=False)
    cfg = ModelConfig.from_hf(path)
    with monkeypatch.context() as mp:
        mp.setattr(model_runner, "backend_class", lambda layout, device, name: LatentTritonBackend)
        runner = ModelRunner(cfg, config, torch.device("cpu"), torch.bfloat16, 512, SINGLE)
    runner.init_kv_cache(4096)
    runner.graphs = DecodeGraphs(runner.model, config.max_num_seqs, 512 // config.block_size, runner.device,
                                 runner.backend)

    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=4096, warmup=False))
    engine.runner.eager_decode_batches = runner.eager_decode_batches
    log = StepLog(engine)
    warm_up(engine)
    warm_steps = log.take()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, DS_VOCAB) for _ in range(rng.randint(1, 400))] for _ in range(96)]
    params = [SamplingParams(max_tokens=rng.randint(8, 40), ignore_eos=True, temperature=0.6, seed=i) for i in range(96)]
    engine.generate(prompts, params)
    serve_steps = log.take()
    assert max(len(s.input_ids) for s, _, _ in serve_steps if s.is_prefill) > 4096

    at_start = _assert_serving_adds_no_variant(runner, warm_steps, serve_steps, cfg.vocab_size)
    assert any(name.startswith("_align") for name, _, _ in at_start)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 17])
def test_a_projection_takes_the_kernel_its_rows_call_for(rows):
    """ops' projections of 16-bit rows on the Triton path: one row the batch-1 GEMV, the
    few-row GEMV's rows (`gemv_rows_mma.ENGINE_ROWS`) that kernel, each with its
    SiLU-and-mul in one launch; more rows leave Triton for cuBLAS (F.linear), the SiLU
    then a kernel of its own. The add + norm after several rows is a kernel of its own on
    every path: one program a row, where a GEMV's last program would walk the rows one
    after another."""
    from agent_infer.kernels import ops
    from agent_infer.kernels.triton import gemv_rows_mma

    expected = ("_gemv_row_kernel" if rows == 1
                else "_gemv_rows_mma_kernel" if rows in gemv_rows_mma.ENGINE_ROWS else None)
    dt = torch.bfloat16
    x, w, w2 = torch.randn(rows, 256, dtype=dt), torch.randn(192, 256, dtype=dt), torch.randn(384, 256, dtype=dt)
    residual, norm_w = torch.randn(rows, 192, dtype=dt), torch.ones(192, dtype=dt)
    counter = torch.zeros(rows, dtype=torch.int32)
    calls = {"linear": lambda: ops.linear(x, w), "silu": lambda: ops.linear_silu_mul(x, w2),
             "add_norm": lambda: ops.linear_add_rms_norm(x, w, None, residual, norm_w, 1e-6, counter)}
    for what, call in calls.items():
        recorder = VariantRecorder()
        with dispatch_to_triton(), recorder.active():
            call()
        names = {name for name, _, _ in recorder.variants}
        gemvs = names & {"_gemv_row_kernel", "_gemv_rows_mma_kernel", "_gemv_kernel"}
        assert gemvs == ({expected} if expected else set()), (rows, names)
        if what == "add_norm" and rows > 1:
            assert names == gemvs | {"_fused_add_rms_norm_kernel"}, (rows, names)
        elif expected:  # the epilogue fused: no kernel beside the projection
            assert names == {expected}, (rows, names)

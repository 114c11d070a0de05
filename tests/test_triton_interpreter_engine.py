"""The engine on the Triton path, checked on CPU through Triton's interpreter: a tiny
checkpoint run with every kernel routed to Triton against the torch path. These tests
run in the interpreter child that tests/test_triton_interpreter.py starts (it passes
this file too, and explains why a child); in the normal pytest process this file
defines none.

Run them alone:
    AGENT_INFER_TRITON_CHILD=1 TRITON_INTERPRET=1 python -m pytest -q tests/test_triton_interpreter_engine.py
"""

from __future__ import annotations

import pytest

from tests.test_triton_interpreter import IN_CHILD

if IN_CHILD:

    def _route_to_triton(monkeypatch, backend) -> None:
        """Every kernel through Triton, attention through `backend`."""
        from agent_infer.engine import model_runner
        from agent_infer.kernels import ops

        monkeypatch.setattr(ops, "_use_triton", lambda x: True)
        monkeypatch.setattr(model_runner, "backend_class", lambda layout, device, name: backend)

    def _same_tokens_on_triton(monkeypatch, run, backend) -> None:
        """`run()` gives the same tokens on the torch path and on the Triton path."""
        expected = run()
        _route_to_triton(monkeypatch, backend)
        assert run() == expected

    def test_engine_on_triton_kernels_matches_torch_path(tmp_path, monkeypatch):
        """A tiny checkpoint run by the engine (fp32) with every kernel and the attention
        backend routed to Triton gives the torch path's greedy tokens: ragged prefill,
        a prefix-cache hit (prefill over cached blocks), decode with GQA and q/k norms
        (fused with RoPE and the KV write), and batch-1 decode through the GEMV kernels."""
        from agent_infer.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.attention.dense_triton import DenseTritonBackend
        from agent_infer.sampling_params import SamplingParams
        from tests.tiny_models import write_tiny_model

        path = write_tiny_model("qwen3", str(tmp_path / "qwen3"))  # GQA 4:1, q/k norms, YaRN
        shared = [(7 * i + 3) % 500 + 3 for i in range(37)]
        batches = [[shared], [shared + [11, 12, 13]], [[5, 6, 7], list(range(20, 61))]]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        def run() -> list[list[int]]:
            eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=16))
            try:
                return [o.token_ids for batch in batches for o in eng.generate(batch, params)]
            finally:
                eng.shutdown()

        calls: list[bool] = []

        class CountingBackend(DenseTritonBackend):
            def attend(self, q, cache, meta, scale):
                calls.append(meta.is_prefill)
                return super().attend(q, cache, meta, scale)

        _same_tokens_on_triton(monkeypatch, run, CountingBackend)
        assert {True, False} <= set(calls), "the Triton backend ran no prefill or no decode"

    def test_mixed_batches_on_triton_kernels_match_torch_path(tmp_path, monkeypatch):
        """Mixed steps on the Triton path (decode rows through the decode kernel, prompt
        chunks through the prefill kernel, in one step) give the torch path's tokens."""
        from agent_infer.attention.dense_triton import DenseTritonBackend
        from tests.test_mixed_batches import _run
        from tests.tiny_models import write_tiny_model

        path = write_tiny_model("qwen3", str(tmp_path / "qwen3"))
        expected, _ = _run(path, mixed=True, async_scheduling=True, max_tokens=4)
        mixed_calls: list[int] = []

        class CountingBackend(DenseTritonBackend):
            def attend(self, q, cache, meta, scale):
                if meta.is_prefill and meta.num_decode:
                    mixed_calls.append(meta.num_decode)
                return super().attend(q, cache, meta, scale)

        _route_to_triton(monkeypatch, CountingBackend)
        got, _ = _run(path, mixed=True, async_scheduling=True, max_tokens=4)
        assert got == expected
        assert mixed_calls, "no mixed step reached the Triton backend"

    def test_batch_invariant_on_triton_kernels(tmp_path, monkeypatch):
        """batch_invariant with every kernel routed to Triton: decode and verify steps, of
        one row and of several, send every projection (the LM head too) through the mode's
        GEMM (gemv_rows_mma.linear_rows_mma; SiLU-and-mul in its epilogue) and
        their attention through the one-row step's shares (several a program where a step
        of several rows has a smaller grid), and each prompt's greedy tokens, decoded beside
        others with drafts, equal its tokens decoded alone."""
        from agent_infer.attention import dense_triton
        from agent_infer.config import EngineConfig
        from agent_infer.engine import model_runner
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.kernels import ops
        from agent_infer.kernels.triton import decode_attention as dec
        from agent_infer.kernels.triton import gemv_rows_mma
        from agent_infer.sampling_params import SamplingParams
        from tests.drafters import Replay
        from tests.test_speculative import NGRAM, _arrivals, spec_engine
        from tests.tiny_models import write_tiny_model

        path = write_tiny_model("qwen3", str(tmp_path / "qwen3"))
        rows: list[int] = []
        silu: list[bool] = []
        splits: set = set()
        invariant, attend = gemv_rows_mma.linear_rows_mma, dense_triton.decode_attention

        def counting(x, *a, **k):
            rows.append(x.shape[0])
            silu.append(k.get("silu_mul", False))
            return invariant(x, *a, **k)

        monkeypatch.setattr(gemv_rows_mma, "linear_rows_mma", counting)
        monkeypatch.setattr(dense_triton, "decode_attention",
                            lambda q, *a, **k: splits.add((q.shape[0] > 1, k.get("shares"))) or attend(q, *a, **k))
        monkeypatch.setattr(ops, "_use_triton", lambda x: True)
        monkeypatch.setattr(model_runner, "backend_class", lambda layout, device, name: dense_triton.DenseTritonBackend)
        # Fewer, larger programs than a GPU's launches: the interpreter runs each in turn.
        # A one-row step cuts keys into 3 shares; several rows get 2 programs a row.
        monkeypatch.setattr(dense_triton, "decode_num_splits", lambda batch, kv_heads, device: 3)
        monkeypatch.setattr(dec, "decode_num_splits", lambda batch, kv_heads, device: 3 if batch == 1 else 2)
        shared_launches: list[int] = []  # the rows of each launch of the shares kernel
        shares_kernel = dec._decode_shares_kernel

        class CountingLaunches:
            def __getitem__(self, grid):
                shared_launches.append(grid[1])
                return shares_kernel[grid]

        monkeypatch.setattr(dec, "_decode_shares_kernel", CountingLaunches())
        prompts = [[(7 * i + 3) % 500 + 3 for i in range(9)], [9, 10, 11, 12]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 4)]
        config = dict(device="cpu", dtype="float32", num_kv_blocks=64, batch_invariant=True)
        alone = LLMEngine(EngineConfig(model=path, **config))
        outs = [alone.generate([p], q)[0] for p, q in zip(prompts, params)]
        spec = spec_engine(path, **config, speculative_config={**NGRAM, "num_speculative_tokens": 2})
        spec.drafter = Replay(outs)  # a random model repeats nothing: drafts from its own path, some wrong
        assert _arrivals(spec, prompts, params) == [o.token_ids for o in outs]
        stats = spec.draft_policy.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
        assert min(rows) == 1 and max(rows) > 1, f"the mode's GEMM took no one-row or no multi-row step: {rows}"
        # One of a layer's four projections ends in SiLU-and-mul, in the GEMM's epilogue.
        assert {r for r, fused in zip(rows, silu) if fused} == set(rows), "SiLU-and-mul not fused at every row count"
        assert {(True, 3)} <= splits and {n for _, n in splits} == {3}, splits
        assert shared_launches and min(shared_launches) > 1, "no step of several rows took the shares kernel"

    def test_deepseek_on_triton_kernels_matches_torch_path(tmp_path, monkeypatch):
        """A tiny DeepSeek-V3 checkpoint (fp32) with every kernel routed to Triton (the MLA
        rope + latent store, absorbed decode, prefill over the latent read back, the fused
        MoE) gives the torch path's greedy tokens, a prefix-cache hit included."""
        from agent_infer.attention.mla import LatentTritonBackend
        from agent_infer.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.sampling_params import SamplingParams
        from tests.deepseek_models import write_deepseek_model

        path = write_deepseek_model("v3", str(tmp_path / "v3"))
        shared = [(7 * i + 3) % 300 + 3 for i in range(37)]
        batches = [[shared], [shared + [11, 12, 13], [5, 6, 7]]]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        def run() -> list[list[int]]:
            eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=16))
            return [o.token_ids for batch in batches for o in eng.generate(batch, params)]

        calls: list[bool] = []

        class CountingBackend(LatentTritonBackend):
            def decode(self, q_lat, cache, meta, scale):
                calls.append(False)
                return super().decode(q_lat, cache, meta, scale)

            def prefill(self, *args):
                calls.append(True)
                return super().prefill(*args)

        _same_tokens_on_triton(monkeypatch, run, CountingBackend)
        assert {True, False} <= set(calls), "the Triton backend ran no prefill or no decode"

    def test_deepseek_prefill_in_context_windows_on_triton_matches_torch_path(tmp_path, monkeypatch):
        """Chunked prefill whose context is cut into windows (a 32-row tile) on the Triton
        prefill kernel, merged, gives the torch path's greedy tokens."""
        from agent_infer.attention.mla import LatentTorchBackend, LatentTritonBackend
        from agent_infer.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.sampling_params import SamplingParams
        from tests.deepseek_models import write_deepseek_model

        path = write_deepseek_model("v3", str(tmp_path / "v3"))
        prompts = [[(7 * i + 3) % 300 + 3 for i in range(50)], [(5 * i + 1) % 300 + 3 for i in range(29)]]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        monkeypatch.setattr(LatentTorchBackend, "context_tile_tokens", 32)

        def run() -> list[list[int]]:
            eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=16,
                                         max_num_batched_tokens=24))
            return [o.token_ids for o in eng.generate(prompts, params)]

        windowed: list[int] = []

        class CountingBackend(LatentTritonBackend):
            def prefill(self, q_nope, q_pe, k_nope, k_pe, v, ctx, window, scale):
                windowed.append(window.key_start is not None)
                return super().prefill(q_nope, q_pe, k_nope, k_pe, v, ctx, window, scale)

        _same_tokens_on_triton(monkeypatch, run, CountingBackend)
        assert any(windowed), "no prefill ran in windows"

    @pytest.mark.parametrize("family", ["qwen3", "v3"])
    def test_verify_steps_on_triton_kernels_match_plain_decoding(tmp_path, monkeypatch, family):
        """Speculative verify steps on the Triton decode kernels (dense and MLA): with two
        sequences of k + 1 rows each, a step holds more rows than max_num_seqs, and the
        greedy tokens equal plain decoding's on the torch path."""
        from agent_infer.attention.dense_triton import DenseTritonBackend
        from agent_infer.attention.mla import LatentTritonBackend
        from agent_infer.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.sampling_params import SamplingParams
        from tests.deepseek_models import write_deepseek_model
        from tests.drafters import Replay
        from tests.tiny_models import write_tiny_model

        if family == "v3":
            path, backend = write_deepseek_model("v3", str(tmp_path / family)), LatentTritonBackend
        else:
            path, backend = write_tiny_model("qwen3", str(tmp_path / family)), DenseTritonBackend
        prompts = [[(7 * i + 3) % 300 + 3 for i in range(11)], [5, 6, 7, 8]]
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        spec = {"method": "ngram", "num_speculative_tokens": 3}

        def engine(**kw) -> LLMEngine:
            return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=32, block_size=16,
                                          max_num_seqs=2, **kw))

        plain = engine().generate(prompts, params)
        verify_rows: list[int] = []

        class CountingBackend(backend):
            def prepare(self, meta):
                if not meta.is_prefill:
                    verify_rows.append(len(meta.context_lens_host))
                return super().prepare(meta)

        _route_to_triton(monkeypatch, CountingBackend)
        eng = engine(speculative_config=spec)
        eng.draft_policy.batch_drafts = lambda num_decoding: True
        eng.drafter = Replay(plain)
        got = eng.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
        assert max(verify_rows) > 2, f"no verify step held more rows than sequences: {verify_rows}"
        assert eng.draft_policy.stats.num_accepted_tokens > 0

    def test_prompt_lookup_on_the_device_through_the_engine(tmp_path, monkeypatch):
        """Prompt lookup itself with every kernel on Triton: rows drafted behind a row in
        flight get their drafts from `ngram.lookup_drafts` in the engine's own steps
        (placeholders resolved, rows moved back first), and the greedy tokens equal plain
        decoding's on the torch path."""
        from agent_infer.attention.dense_triton import DenseTritonBackend
        from agent_infer.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.kernels.triton import ngram
        from agent_infer.sampling_params import SamplingParams
        from tests.tiny_models import write_tiny_model

        path = write_tiny_model("qwen3", str(tmp_path / "qwen3"))
        prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41, 42], list(range(20, 61))]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        config = dict(model=path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=16)
        plain = LLMEngine(EngineConfig(**config)).generate(prompts, params)
        _route_to_triton(monkeypatch, DenseTritonBackend)
        launches: list[int] = []
        lookup = ngram.lookup_drafts
        monkeypatch.setattr(ngram, "lookup_drafts", lambda ids, hist, offsets, *a, **k:
                            launches.append(offsets.numel() - 1) or lookup(ids, hist, offsets, *a, **k))
        eng = LLMEngine(EngineConfig(**config, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}))
        eng.draft_policy.batch_drafts = lambda num_decoding: True
        eng.draft_policy.may_draft = lambda request_id, length: True  # drafts that fail do not pause
        got = eng.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
        assert len(launches) >= 2 and max(launches) >= 2, launches  # a launch of several rows among them

"""The Triton kernels, checked on CPU through Triton's interpreter (small sizes).

Why a subprocess: TRITON_INTERPRET=1 is read when triton is imported, and must not leak
into other tests of the same pytest process (nor can it work if triton was already
imported there). So in the normal run this file holds one test that waits for a child
pytest on this same file (and tests/test_triton_interpreter_engine.py, the engine on the
Triton path) with TRITON_INTERPRET=1 and a marker variable in its environment; in the
child the marker is set and the real, parametrised checks are defined instead. The child is started as soon as collection ends (`tests/conftest.py`),
so that its single-threaded interpretation runs beside the rest of the suite rather than
after it. A missing triton fails loudly (triton is a test dependency on Linux).

Run the checks alone, verbosely:
    AGENT_INFER_TRITON_CHILD=1 TRITON_INTERPRET=1 python -m pytest -q tests/test_triton_interpreter.py \
        tests/test_triton_interpreter_engine.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CHILD_MARKER = "AGENT_INFER_TRITON_CHILD"
IN_CHILD = os.environ.get(CHILD_MARKER) == "1" and os.environ.get("TRITON_INTERPRET") == "1"
TEST_NAME = "test_triton_kernels_under_interpreter"
_TIMEOUT_S = 1200

if not IN_CHILD:

    class _Child:
        """The child pytest, started once; its output goes to a file (a pipe nobody reads
        while other tests run would fill and stall it)."""

        proc: subprocess.Popen | None = None
        log = None

        @classmethod
        def start(cls) -> None:
            if cls.proc is not None or importlib.util.find_spec("triton") is None:
                return
            root = Path(__file__).resolve().parents[1]
            # One thread and the lowest priority: the interpreter is single-threaded numpy,
            # and it should take only the cores the rest of the suite leaves idle.
            env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", **{CHILD_MARKER: "1"})
            here = Path(__file__)
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", str(here),
                   str(here.with_name("test_triton_interpreter_engine.py"))]
            cls.log = tempfile.TemporaryFile(mode="w+")
            cls.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=cls.log, stderr=subprocess.STDOUT, text=True,
                                        preexec_fn=_lowest_priority)

        @classmethod
        def result(cls) -> tuple[int, str]:
            cls.start()
            try:
                code = cls.proc.wait(_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                cls.proc.kill()
                code = cls.proc.wait()
            cls.log.seek(0)
            return code, cls.log.read()

        @classmethod
        def stop(cls) -> None:
            if cls.proc is not None and cls.proc.poll() is None:
                cls.proc.kill()
                cls.proc.wait()

    def _lowest_priority() -> None:
        os.nice(19)

    def stop_child() -> None:
        _Child.stop()

    def start_child() -> None:
        """Start the checks now (the conftest's hook, when this test is selected)."""
        _Child.start()

    def test_triton_kernels_under_interpreter():
        assert importlib.util.find_spec("triton") is not None, (
            "triton is not installed: the kernel tests need it (pip install 'triton>=3.0' on Linux)"
        )
        code, out = _Child.result()
        tail = out[-12000:]
        assert code == 0, f"interpreter kernel checks failed (exit code {code}):\n{tail}"
        assert " passed" in out and " skipped" not in out, f"unexpected child result:\n{tail}"

else:
    import torch

    from agent_infer.kernels.triton.gemv import GemvConfig, RowConfig
    from agent_infer.kernels.triton.gemv_rows_mma import MmaConfig
    from tests import attention_checks as ac
    from tests import kernel_checks as kc

    kc.patch_interpreter_scalar_index()
    kc.patch_interpreter_device_calls()

    DEV = "cpu"
    ALL = [torch.float32, torch.float16, torch.bfloat16]
    # tl.dot on bf16 gives garbage in the interpreter; the GPU tests cover bf16 attention.
    DOT_DTYPES = [torch.float32, torch.float16]

    @pytest.mark.parametrize("dtype", ALL)
    @pytest.mark.parametrize(
        "tokens,heads,dim,strided", [(7, None, 96, False), (5, 4, 64, True), (3, 2, 48, False), (1, 3, 128, True)]
    )
    def test_rms_norm(dtype, tokens, heads, dim, strided):
        kc.check_rms_norm(DEV, dtype, tokens, heads, dim, strided)

    @pytest.mark.parametrize("dtype", ALL)
    @pytest.mark.parametrize("tokens,dim", [(7, 200), (1, 64), (33, 96)])
    def test_fused_add_rms_norm(dtype, tokens, dim):
        kc.check_fused_add_rms_norm(DEV, dtype, tokens, dim)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("rows,vocab", [(1, 503), (5, 10007)])
    def test_gumbel_sample(dtype, rows, vocab):
        kc.check_gumbel_sample(DEV, dtype, rows, vocab)

    @pytest.mark.parametrize("dtype", ALL)
    @pytest.mark.parametrize("shape", [(5, 400), (2, 3, 128), (1, 2 * 1100)])
    def test_silu_and_mul(dtype, shape):
        kc.check_silu_and_mul(DEV, dtype, shape)

    @pytest.mark.parametrize("dtype", ALL)
    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("qk_norm", [True, False])
    @pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (64, 32)])
    def test_norm_rope_store(dtype, is_neox, qk_norm, head_dim, rot_dim):
        kc.check_norm_rope_store(DEV, dtype, 7, 4, 2, head_dim, rot_dim, is_neox, qk_norm)
        # heads in groups: two per program, and the grouped form the kernel picks itself
        # from GROUP_FROM_TOKENS tokens on (8 q + 4 k heads: four per program)
        kc.check_norm_rope_store(DEV, dtype, 7, 4, 2, head_dim, rot_dim, is_neox, qk_norm, group=2)
        kc.check_norm_rope_store(DEV, dtype, 64, 8, 4, head_dim, rot_dim, is_neox, qk_norm)

    @pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.5, 4.0)], ids=str)
    def test_norm_rope_store_fp8_cache_scales(kv_scales):
        """V (fp8 values times its scale) lands exactly; K within 15 %: the interpreter's
        fp32 -> fp8 conversion departs from torch's by up to ~9 % (in norm) on random
        values, where a K scale not applied would be 50 % off."""
        kc.check_norm_rope_store(DEV, torch.float32, 7, 4, 2, 64, 64, True, True, cache_dtype=kc.FP8,
                                 kv_scales=kv_scales, k_cache_tol=0.15)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("block_size", [16, 32])
    def test_store_kv(dtype, block_size):
        ac.check_store_kv(DEV, dtype, 13, 2, 64, block_size)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (512.0, 0.25)], ids=str)
    def test_store_kv_fp8_cache(dtype, kv_scales):
        ac.check_store_kv(DEV, dtype, 13, 2, 64, 16, cache_dtype=kc.FP8, exact_values=True, kv_scales=kv_scales)

    PREFILL_CASES = [
        # query lens, cached prefix lens, heads, kv heads, head_dim, block size
        ([5, 17, 33], [0, 16, 23], 8, 2, 64, 16),  # GQA 4, prefixes ending on/off a block edge
        ([20, 1, 9], [13, 40, 0], 8, 1, 64, 32),  # GQA 8, one-token chunk
        ([30], [0], 4, 4, 96, 16),  # MHA, head_dim 96 (masked)
        ([150, 3], [5, 60], 2, 1, 128, 16),  # several query tiles
    ]

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"q{c[0]}-p{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-bs{c[5]}")
    def test_prefill_attention(dtype, case):
        ac.check_prefill(DEV, dtype, *case)

    DECODE_CASES = [
        # context lens, heads, kv heads, head_dim, block size, forced split count
        ([1, 17, 100], 8, 2, 64, 16, 3),
        ([33, 64, 65, 250], 8, 1, 64, 32, 5),
        ([5, 129], 4, 4, 96, 16, 2),
        ([300], 16, 4, 128, 16, 7),
    ]

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"c{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-bs{c[4]}-s{c[5]}")
    def test_decode_attention(dtype, case):
        ac.check_decode(DEV, dtype, *case)

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    def test_attention_fp8_cache(dtype):
        """An fp8 cache read back as the model's dtype, in both attention kernels (the
        step's K/V are fp8 values, so the interpreter's cache writes are exact)."""
        ac.check_prefill(DEV, dtype, *PREFILL_CASES[0], cache_dtype=kc.FP8)
        ac.check_decode(DEV, dtype, *DECODE_CASES[0], cache_dtype=kc.FP8)

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
    def test_attention_fp8_cache_scales(dtype, prefill):
        ac.check_attention_kv_scales(DEV, dtype, prefill, (512.0, 256.0))

    @pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
    def test_attention_fp8_cache_scale_share(prefill):
        ac.check_attention_scale_share(DEV, prefill)

    @pytest.mark.parametrize("kv_heads", [8, 4, 1])
    def test_decode_preload_only_in_one_wave(kv_heads):
        """The first-tile preload, which fits two programs per SM, is taken exactly by
        grids that are resident at once (two per SM, 132 SMs off a GPU): batch 1 does, a
        large batch does not; the split count still fills about two programs per SM."""
        from agent_infer.kernels.triton.decode_attention import decode_num_splits, preload_first_tile

        dev = torch.device("cpu")
        resident = 2 * 132
        for batch in range(1, 600):
            splits = decode_num_splits(batch, kv_heads, dev)
            programs = batch * kv_heads * splits
            assert programs >= min(resident, batch * kv_heads * 64), (batch, splits)
            assert preload_first_tile(batch, kv_heads, splits, dev) == (programs <= resident), (batch, splits)
        assert preload_first_tile(1, kv_heads, decode_num_splits(1, kv_heads, dev), dev)
        assert not preload_first_tile(512, kv_heads, decode_num_splits(512, kv_heads, dev), dev)

    @pytest.mark.parametrize("num_splits", [1, 3])
    def test_decode_order(num_splits):
        ac.check_decode_order(DEV, torch.float32, [40, 3, 150, 77, 18], num_splits)

    def test_decode_order_only_past_one_wave():
        """Rows go in the given order exactly when the grid is more than one wave: four
        programs per SM, three when they merge splits (132 SMs off a GPU). With the
        engine's split rule and 8 KV heads: 25-32 sequences (two splits, merged), none
        from 33 to 66 (one split each, one wave), all from 67."""
        from agent_infer.kernels.triton.decode_attention import decode_num_splits, ordered_rows

        dev = torch.device("cpu")
        for batch in range(1, 300):
            splits = decode_num_splits(batch, 8, dev)
            for merge in (False, True):
                per_sm = 3 if merge and splits > 1 else 4
                want = batch * 8 * splits > per_sm * 132
                assert ordered_rows(batch, 8, splits, merge and splits > 1, dev) == want, (batch, merge)
        rule = {b: decode_num_splits(b, 8, dev) for b in range(1, 300)}
        engine = [b for b, splits in rule.items() if ordered_rows(b, 8, splits, splits > 1, dev)]
        assert engine == list(range(25, 33)) + list(range(67, 300))

    @pytest.mark.parametrize("num_splits", [1, 4])
    def test_decode_padding_rows(num_splits):
        ac.check_decode_padding_rows(DEV, torch.float32, 16, num_splits)

    MERGED_DECODE_CASES = [
        # context lens, heads, kv heads, head_dim, block size, forced split counts, padding rows
        ([1, 17, 100, 300], 8, 2, 64, 16, (2, 3, 8), 2),  # GQA 4; short contexts write directly
        ([33, 64, 65, 250], 8, 1, 64, 32, (5, 16), 0),  # GQA 8; most of 16 shares are empty
        ([129, 7], 4, 4, 96, 16, (2, 4), 1),  # MHA, head_dim 96 (masked)
        ([600, 90], 16, 1, 128, 16, (5, 16), 0),  # GQA 16: the merge takes 4 splits a round
    ]

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize(
        "case", MERGED_DECODE_CASES, ids=lambda c: f"c{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-bs{c[4]}-s{c[5]}-pad{c[6]}"
    )
    def test_decode_attention_merged(dtype, case):
        ac.check_decode_merged(DEV, dtype, *case)

    SHARES_CASES = [
        # context lens (odd: 1, a block, many blocks + 1, one partial tile), shares, grids, preload
        ([1, 16, 17, 300, 1000], 8, (1, 3), True),  # shares of several tiles ending partial
        ([1, 16, 17, 300, 1000], 8, (3,), False),
        ([65, 33], 16, (5,), True),  # most shares empty
    ]

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize("case", SHARES_CASES, ids=lambda c: f"c{c[0]}-s{c[1]}-g{c[2]}-{'pre' if c[3] else 'no'}")
    def test_decode_shares_match_one_row(dtype, case):
        ac.check_decode_shares(DEV, dtype, *case)

    GEMV_CASES = [
        # M, N, K, bias, config (None = default heuristic)
        (1, 100, 256, True, None),
        (3, 70, 200, False, None),
        (16, 64, 512, True, GemvConfig(32, 64, split_k=3, use_dot=True)),
        (1, 50, 300, False, GemvConfig(16, 64, split_k=4)),
        (5, 33, 128, False, GemvConfig(16, 32, split_k=2, use_dot=True)),
        (40, 48, 256, True, GemvConfig(16, 64, split_k=2, use_dot=True)),  # rows padded to 64
        (17, 40, 96, False, None),  # rows padded to 32, the default config
        (5, 100, 128, True, GemvConfig(64, 32, split_k=2, use_dot=True, swap_ab=True)),  # the weight on the left
        (3, 64, 96, False, GemvConfig(64, 64, use_dot=True, swap_ab=True)),
    ]

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: f"m{c[0]}-n{c[1]}-k{c[2]}-b{int(c[3])}-{c[4]}")
    def test_gemv(dtype, case):
        kc.check_gemv(DEV, dtype, *case)

    @pytest.mark.parametrize("dtype", ALL)
    @pytest.mark.parametrize(
        "n,k,bias,silu_mul,config",
        [(100, 256, True, False, RowConfig(8, 64)), (48, 512, False, True, RowConfig(4, 128)),
         (7, 64, True, True, None), (33, 192, False, False, RowConfig(2, 64)),
         (48, 512, False, True, RowConfig(4, 128, prefetch=2)), (33, 192, True, False, RowConfig(2, 64, prefetch=2)),
         (20, 64, False, False, RowConfig(4, 64, prefetch=2))],
    )
    def test_gemv_m1(dtype, n, k, bias, silu_mul, config):
        kc.check_gemv_m1(DEV, dtype, n, k, bias, silu_mul, config)

    # The few-row GEMV on the tensor cores, 1-16 rows in one variant: tails of weight rows,
    # tiles of one and several programs, K loops of one and several tiles, SiLU-and-mul,
    # K tails (a last tile past K, a K shorter than one tile, with the early first tile).
    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize(
        "m,n,k,bias,config,epilogue",
        [(5, 100, 256, True, None, "plain"), (1, 33, 64, False, MmaConfig(16, 64, 1, 1), "plain"),
         (16, 70, 128, False, MmaConfig(32, 32, 2, 2), "plain"), (8, 48, 192, True, MmaConfig(16, 64, 2, 3), "silu"),
         (3, 20, 64, False, None, "silu"), (9, 600, 64, False, MmaConfig(64, 64, 4, 2), "plain"),
         (13, 130, 512, True, None, "plain"), (2, 100, 256, True, None, "silu"),
         (5, 40, 200, True, MmaConfig(16, 64, 1, 2, False), "plain"), (3, 24, 80, False, MmaConfig(16, 128, 1, 2), "silu"),
         (9, 33, 576, False, MmaConfig(32, 256, 2, 3), "plain")],
    )
    def test_gemv_rows_mma(dtype, m, n, k, bias, config, epilogue):
        kc.check_gemv_rows(DEV, dtype, m, n, k, bias, config, epilogue)

    # The batch-invariant mode's projections: m rows in one launch, each as its own M = 1.
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("epilogue", ["plain", "silu", "add_norm"])
    @pytest.mark.parametrize("m,n,k,bias,config,fp8", [
        (5, 100, 256, True, RowConfig(8, 64), None), (3, 48, 512, False, RowConfig(4, 128, prefetch=2), None),
        (2, 48, 256, True, RowConfig(8, 64), (16, 32)), (4, 40, 192, False, None, "channel"),
    ], ids=lambda c: str(c))
    def test_gemv_m1_rows_invariant(dtype, epilogue, m, n, k, bias, config, fp8):
        kc.check_gemv_m1_rows_invariant(DEV, dtype, m, n, k, bias, epilogue, config, fp8=fp8)

    # The mode's GEMM (the few-row GEMV over tiles of rows): long and short K loops (80
    # columns: 16-column tiles), SiLU-and-mul, the add + norm kernel after it, partial
    # tiles of rows and of columns, row counts of one and several tiles.
    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize("n,k,bias,epilogue", [(40, 2048, True, "plain"), (100, 576, False, "plain"),
                                                   (33, 80, True, "plain"), (24, 576, True, "silu"),
                                                   (40, 208, False, "silu"), (100, 576, True, "add_norm"),
                                                   (40, 2048, False, "add_norm")])
    def test_gemv_invariant(dtype, n, k, bias, epilogue):
        kc.check_gemv_invariant(DEV, dtype, n, k, bias, (1, 5, 17, 40), epilogue)

    @pytest.mark.parametrize("epilogue", ["plain", "add_norm"])
    def test_gemv_m1_rows_past_the_grid_limit(epilogue, monkeypatch):
        """More output blocks than the grid's second axis holds: a launch per row, the
        same rows."""
        from agent_infer.kernels.triton import gemv

        monkeypatch.setattr(gemv, "MAX_GRID_Y", 3)
        kc.check_gemv_m1_rows_invariant(DEV, torch.bfloat16, 3, 40, 128, True, epilogue, RowConfig(8, 64))

    # fp8 weights: blocks of (rows, columns) with a partial last row of blocks, and per row.
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("fp8", [(16, 32), (8, 64), "channel"], ids=str)
    @pytest.mark.parametrize(
        "n,k,bias,silu_mul,config",
        [(40, 192, True, False, RowConfig(4, 64, prefetch=2)), (48, 256, False, True, RowConfig(4, 64)),
         (48, 256, True, True, RowConfig(8, 64, prefetch=2)), (40, 192, False, False, None)],
    )
    def test_gemv_m1_fp8(dtype, fp8, n, k, bias, silu_mul, config):
        kc.check_gemv_m1(DEV, dtype, n, k, bias, silu_mul, config, fp8=fp8)

    @pytest.mark.parametrize("silu_mul", [False, True])
    def test_gemv_m1_fp8_blocks_narrower_than_whole_words(silu_mul):
        """Blocks of 6 columns: a word's four columns can span two blocks, so each column
        loads its own scale (the per-word load serves blocks that hold whole words)."""
        kc.check_gemv_m1(DEV, torch.float32, 48, 192, True, silu_mul, RowConfig(4, 64), fp8=(8, 6))

    def test_gemv_m1_every_e4m3_value():
        kc.check_gemv_m1_every_e4m3_value(DEV, RowConfig(4, 128, prefetch=2))

    @pytest.mark.parametrize("fp8", [(16, 32), "channel"], ids=str)
    def test_gemv_m1_add_norm_fp8(fp8):
        kc.check_gemv_m1_add_norm(DEV, torch.bfloat16, 48, 256, True, RowConfig(8, 64), fp8=fp8)

    @pytest.mark.parametrize("dtype", ALL)
    @pytest.mark.parametrize(
        "n,k,bias,config", [(100, 256, True, RowConfig(8, 64)), (64, 128, False, None), (33, 192, False, RowConfig(2, 64)),
                            (100, 256, True, RowConfig(8, 64, prefetch=2))]
    )
    def test_gemv_m1_add_norm(dtype, n, k, bias, config):
        kc.check_gemv_m1_add_norm(DEV, dtype, n, k, bias, config)

    @pytest.mark.parametrize("dtype", ALL)
    @pytest.mark.parametrize("rows,vocab", [(1, 20000), (3, 8192), (4, 100)])
    def test_argmax(dtype, rows, vocab):
        kc.check_argmax(DEV, dtype, rows, vocab)

    @pytest.mark.parametrize("n", [1, 37, 1500])
    def test_fill_placeholders(n):
        kc.check_fill_placeholders(DEV, n)

    @pytest.mark.parametrize("max_k,min_n,max_n,block", [(8, 2, 4, 64), (4, 1, 3, 32), (1, 1, 1, 16), (5, 3, 3, 128)])
    def test_lookup_drafts(max_k, min_n, max_n, block):
        kc.check_lookup_drafts(DEV, max_k, min_n, max_n, block)

    @pytest.mark.parametrize("num_seqs,max_k", [(1, 4), (7, 8), (40, 16)])
    def test_resolve_rows(num_seqs, max_k):
        kc.check_resolve_rows(DEV, num_seqs, max_k)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("rows,vocab,words", [(1, 100, 4), (3, 5000, 157), (4, 9000, 200)])
    def test_apply_token_bitmask(dtype, rows, vocab, words):
        kc.check_apply_token_bitmask(DEV, dtype, rows, vocab, words)

    def test_gumbel_never_samples_banned_tokens():
        kc.check_gumbel_never_samples_banned_tokens(DEV, 1024)

    def test_gemv_bf16_fma_path():
        kc.check_gemv(DEV, torch.bfloat16, 1, 100, 256, True, GemvConfig(16, 64, split_k=2))

    @pytest.mark.parametrize("dtype,world", [(torch.float32, 2), (torch.bfloat16, 2), (torch.float32, 3)])
    def test_all_reduce_add_rms_norm_between_processes(dtype, world):
        """The fused all-reduce + add + RMSNorm kernel run by `world` processes on buffers
        in shared memory (each process maps them at its own addresses, as symmetric memory
        does): the wait on not-arrived marks, signed zeros in the data, the double buffer
        and arithmetic, over calls of changing row counts (tests/fused_allreduce_checks.py)."""
        from tests.fused_allreduce_checks import run_interpreter_ranks

        run_interpreter_ranks(dtype, world)

    def test_all_reduce_add_rms_norm_across_the_call_count_wrap():
        """The int32 call count wraps negative after 2**31 calls (about a day of batch-1
        decode at TP = 2); the buffer half must stay bit 0 of it, never a negative index."""
        from tests.fused_allreduce_checks import INTERPRETER_CALLS, run_interpreter_ranks

        run_interpreter_ranks(torch.float32, 2, first_call=2**31 - len(INTERPRETER_CALLS) // 2)

    # ---- DeepSeek MLA kernels (tests/mla_checks.py) -----------------------------------
    # Odd tiny shapes on purpose: latent widths and rope dims that are not powers of two
    # (masked tiles), 3 or 20 heads (padded head blocks), block sizes 16 and 32; one case
    # at the real widths (L 512, R 64).

    from agent_infer.kernels.triton.mla_decode import MlaDecodeConfig
    from agent_infer.kernels.triton.mla_prefill import MlaPrefillConfig
    from tests import mla_checks as mc

    MLA_DECODE_CASES = [
        # context lens, heads, L, R, block size, forced split counts, config (None: default)
        ([1, 17, 100], 3, 48, 16, 16, (2, 5), None),
        ([33, 64, 65, 7], 20, 40, 8, 32, (3,), None),  # two head blocks, the second 4 of 16
        ([90, 31], 3, 48, 16, 16, (4,), MlaDecodeConfig(32, 16, 4, 2)),  # 32 heads a block
        ([70], 16, 512, 64, 16, (3,), None),  # V2-Lite's widths
        ([1, 16, 81], 3, 48, 16, 16, (1, 4, 7), None),  # one token, one block, many blocks + 1
        ([1, 63, 64, 130], 3, 48, 16, 64, (2, 5), None),  # key tiles inside 64-token blocks
    ]

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize(
        "case", MLA_DECODE_CASES, ids=lambda c: f"c{c[0]}-h{c[1]}-L{c[2]}-R{c[3]}-bs{c[4]}-s{c[5]}-{c[6]}"
    )
    def test_mla_decode(dtype, case):
        contexts, heads, rank, rope, block_size, splits, config = case
        mc.check_mla_decode(DEV, dtype, contexts, heads, rank, rope, block_size, splits, padding_rows=1, config=config)

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    def test_mla_decode_fp8_cache(dtype):
        """An fp8 latent cache whose entries times the scale are the rows (the scale in the
        scores and the output; fp16 dots for 16-bit queries): one split, two kernels and
        the in-launch merge; a scale left out is 8x off in the rows."""
        mc.check_mla_decode(DEV, dtype, [1, 17, 100], 3, 48, 16, 16, (3,), padding_rows=1,
                            cache_dtype=kc.FP8, cache_scale=0.125)

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize("block_size", [16, 32])
    def test_mla_decode_strided_rows(dtype, block_size):
        """Cache rows with a stride past L + R (views of wider rows), where a key tile spans
        cache blocks (16-token blocks, 32-key bf16 tiles) and where it lies in one (the
        stride then at run time, not the packed rows' constant)."""
        mc.check_mla_decode(DEV, dtype, [1, 33, 70], 3, 48, 16, block_size, (3,), padding_rows=1, row_padding=8)

    def test_mla_decode_pool_layout():
        """The KV pool's per-layer view [blocks, block_size, 1, L + R] reads as the 3-d cache."""
        mc.check_mla_decode(DEV, torch.float32, [40, 9], 3, 48, 16, 16, (2,), padding_rows=0, pool_layout=True)

    def test_mla_decode_splits_from_shapes():
        """The split count fills the two programs per SM (132 SMs off a GPU) in one wave,
        from batch and heads alone: never a program past them when split, and one more
        split would overflow them (or MAX_SPLITS is reached)."""
        from agent_infer.kernels.triton.mla_decode import MAX_SPLITS, mla_decode_num_splits

        dev = torch.device("cpu")
        slots = 2 * 132
        assert mla_decode_num_splits(1, 16, dev) == MAX_SPLITS
        assert mla_decode_num_splits(32, 16, dev) == 8  # 9 would put 24 programs in a second wave
        for heads in (4, 8, 16, 128):
            blocks = -(-heads // 16)
            for batch in range(1, 300):
                splits = mla_decode_num_splits(batch, heads, dev)
                units = batch * blocks
                assert splits == 1 or units * splits <= slots, (heads, batch, splits)
                assert splits == MAX_SPLITS or units * (splits + 1) > slots, (heads, batch, splits)

    MLA_PREFILL_CASES = [
        # query lens, cached prefix lens, heads, Dn, R, Dv, config
        ([5, 17, 33], [0, 16, 23], 3, 24, 8, 20, None),  # no power of two anywhere
        ([20, 1, 0, 9], [13, 40, 5, 0], 2, 32, 16, 16, None),  # a one-token chunk, an empty sequence
        ([70, 3], [5, 60], 2, 24, 8, 20, MlaPrefillConfig(32, 16, 4, 1)),  # several query tiles
        ([40], [10], 2, 128, 64, 128, None),  # the real widths
    ]

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize(
        "case", MLA_PREFILL_CASES, ids=lambda c: f"q{c[0]}-p{c[1]}-h{c[2]}-d{c[3]}/{c[4]}/{c[5]}-{c[6]}"
    )
    def test_mla_prefill(dtype, case):
        mc.check_mla_prefill(DEV, dtype, *case)

    MLA_WINDOW_CASES = [
        # query lens, cached prefix lens, window width, heads, Dn, R, Dv, config
        ([5, 17, 33], [0, 16, 23], 16, 3, 24, 8, 20, None),  # windows inside the queries too
        ([1, 40], [47, 0], 17, 2, 32, 16, 16, MlaPrefillConfig(32, 16, 4, 1)),  # odd width, several key tiles
        ([9], [100], 64, 2, 128, 64, 128, None),  # the real widths, two windows
    ]

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize("case", MLA_WINDOW_CASES, ids=lambda c: f"q{c[0]}-p{c[1]}-w{c[2]}-h{c[3]}")
    def test_mla_prefill_windows(dtype, case):
        mc.check_mla_prefill_windows(DEV, dtype, *case)

    @pytest.mark.parametrize("dtype", ALL)
    @pytest.mark.parametrize("is_neox", [False, True])
    @pytest.mark.parametrize("tokens,heads,rank,rope,block_size", [(7, 3, 40, 16, 16), (5, 20, 48, 8, 32),
                                                                   (2, 16, 512, 64, 16)])
    def test_mla_rope_store(dtype, is_neox, tokens, heads, rank, rope, block_size):
        mc.check_mla_rope_store(DEV, dtype, tokens, heads, rank, rope, block_size, is_neox)

    def test_mla_rope_store_pool_layout():
        mc.check_mla_rope_store(DEV, torch.float32, 6, 3, 40, 16, 16, pool_layout=True)

    @pytest.mark.parametrize("absorb", [False, True])
    def test_mla_rope_store_fp8_cache(absorb):
        """Rows into an fp8 latent cache divided by its scale; within 15 % since the
        interpreter's fp32 -> fp8 rounding departs from torch's (a scale of 1/16 not
        applied is 94 % off). On a GPU: bit for bit (tests/gpu/test_mla_kernels.py)."""
        mc.check_mla_rope_store(DEV, torch.bfloat16, 5, 3, 40, 16, 16, absorb=absorb, cache_dtype=kc.FP8,
                                cache_scale=0.0625, cache_tol=0.15)

    @pytest.mark.parametrize("dtype", ALL)
    @pytest.mark.parametrize("tokens,heads,rank,rope,block_size,is_neox", [(1, 3, 40, 16, 16, False),
                                                                           (3, 5, 136, 8, 32, True)])
    def test_mla_rope_store_absorb(dtype, tokens, heads, rank, rope, block_size, is_neox):
        """Latent widths that are not a multiple of the 64-column chunks, too."""
        mc.check_mla_rope_store(DEV, dtype, tokens, heads, rank, rope, block_size, is_neox, absorb=True)

    @pytest.mark.parametrize("batch,splits,merged", [(4, None, False), (4, 3, True), (70, None, True)])
    def test_mla_decode_step_on_static_buffers(batch, splits, merged):
        """The rope + cache write and the decode on the static buffers a CUDA graph holds,
        run again with new lengths, tables and inputs (tests/gpu captures the same step)."""
        mc.check_mla_decode_step(DEV, torch.float32, 16, batch, splits, merged, heads=3, rank=48, rope_dim=16,
                                 max_context=150, capture=False)

    # ---- fp8 W8A8 GEMM and activation quantization: tests/fp8_kernel_checks.py ------------

    from tests import fp8_kernel_checks as fp8c

    @pytest.mark.parametrize("case", fp8c.INTERPRETER_CASES, ids=lambda c: c[0])
    def test_fp8_gemm_kernels(case):
        _, check, args = case
        check(DEV, *args)

    # ---- (end of the fp8 checks) --------------------------------------------------------

    # ---- fused MoE (routed experts): tests/moe_checks.py -------------------------------

    from agent_infer.kernels.triton.fused_moe_configs import MoeConfig, Tile
    from tests import moe_checks as moe

    # D = 48, I = 40 (odd on purpose): K tails (48 % 32, 40 % 16), N tails that wrap
    # (I = 40 over 16- and 32-wide tiles, D = 48 over 32), FMA rows and tl.dot tiles.
    MOE_CONFIGS = {
        "default": None,  # the heuristic: block_m 16, K = 48 and 40 inside one 128-wide tile
        "rows": MoeConfig(1, Tile(16, 32), Tile(16, 16)),
        "rows-even": MoeConfig(1, Tile(8, 16, 2, 2), Tile(16, 8, 2, 2)),
        "dot16": MoeConfig(16, Tile(16, 32), Tile(32, 16)),
        "dot32": MoeConfig(32, Tile(32, 16, 4, 2), Tile(16, 32, 4, 2)),
    }

    MOE_CASES = [  # tokens, experts, top_k, configs (the FMA rows run one program per slot: slow here)
        (1, 7, 2, list(MOE_CONFIGS)),
        (37, 7, 3, ["default", "dot16", "dot32"]),
        (37, 5, 2, list(MOE_CONFIGS)),
    ]

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize(
        "tokens,experts,top_k,config", [(t, e, k, c) for t, e, k, cs in MOE_CASES for c in cs], ids=str
    )
    def test_fused_moe(dtype, tokens, experts, top_k, config):
        moe.check_fused_moe(DEV, dtype, tokens, experts, top_k, 48, 40, config=MOE_CONFIGS[config], repeat=True)

    @pytest.mark.parametrize("tokens,local,config,dtype", [
        (1, None, "rows", torch.float32), (1, (2, 3), "rows-even", torch.bfloat16), (9, (2, 3), "rows", torch.float16),
        (1, (2, 3), "default", torch.float16), (37, None, "dot16", torch.float32),
        (37, (2, 3), "default", torch.float32), (37, (2, 3), "dot32", torch.float16)], ids=str)
    def test_fused_moe_fp8_experts(tokens, local, config, dtype):
        """e4m3 experts with one scale per row: at one slot a block (FMA rows) read as int32
        words and converted with integer operations (K tails masked or whole tiles, direct
        and aligned layouts), in tensor-core tiles as x's dtype; all experts local or an
        expert map."""
        moe.check_fused_moe(DEV, dtype, tokens, 7, 3, 48, 40, local=local, config=MOE_CONFIGS[config], fp8=True)

    @pytest.mark.parametrize("tokens,local,config,dtype,block", [
        (1, None, "rows", torch.float32, (16, 32)), (1, (2, 3), "rows-even", torch.bfloat16, (8, 16)),
        (9, (2, 3), "rows", torch.float16, (8, 16)), (37, None, "dot16", torch.float32, (16, 32)),
        (37, (2, 3), "default", torch.float32, (16, 32)), (37, None, "dot32", torch.float16, (8, 16))], ids=str)
    def test_fused_moe_fp8_block_experts(tokens, local, config, dtype, block):
        """e4m3 experts with one scale per block of each expert's matrices (DeepSeek-V3's
        layout, small blocks): D = 40 and I = 48 leave partial blocks of columns in both
        GEMMs and of rows in GEMM 2; tiles wider than a block are fitted to it (FMA rows
        of 16 to blocks of 8 rows, K steps of 128 or 32 to blocks of 32 or 16 columns)."""
        moe.check_fused_moe(DEV, dtype, tokens, 7, 3, 40, 48, local=local, config=MOE_CONFIGS[config], fp8=block)

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    @pytest.mark.parametrize("config", ["default", "rows", "dot16"])
    @pytest.mark.parametrize("tokens,first,count", [(1, 2, 3), (37, 2, 3), (37, 0, 4), (37, 6, 1)])
    def test_fused_moe_expert_map(dtype, config, tokens, first, count):
        """A rank holding experts [first, first + count) of 7, int64 ids (torch.topk's):
        slots of other ranks' experts contribute 0, tokens with none come out 0."""
        moe.check_fused_moe(DEV, dtype, tokens, 7, 3, 48, 40, local=(first, count), config=MOE_CONFIGS[config],
                           id_dtype=torch.int64)

    @pytest.mark.parametrize("config", ["default", "rows", "dot16"])
    @pytest.mark.parametrize("tokens,direct,local", [(1, False, None), (1, True, (2, 3)), (9, True, None),
                                                     (9, True, (1, 4))])
    def test_fused_moe_slot_layouts(config, tokens, direct, local):
        """Both slot layouts at any token count: one token aligned, and the direct layout
        (one block per slot, the expert read from the routing) over several tokens whose
        slots repeat experts (token 1 names one twice), with and without an expert map."""
        moe.check_fused_moe(DEV, torch.float32, tokens, 7, 3, 48, 40, local=local, config=MOE_CONFIGS[config],
                           repeat=True, direct=direct)

    @pytest.mark.parametrize("dtype", ALL)
    def test_fused_moe_rows_all_dtypes(dtype):
        """The FMA rows path has no tl.dot, so bf16 runs in the interpreter too."""
        moe.check_fused_moe(DEV, dtype, 13, 7, 3, 48, 40, config=MOE_CONFIGS["rows"], repeat=True)

    @pytest.mark.parametrize("dtype", DOT_DTYPES)
    def test_fused_moe_even_k_dot_tiles(dtype):
        """I = 32: both GEMMs take the unmasked K loads (EVEN_K) of the tl.dot path."""
        moe.check_fused_moe(DEV, dtype, 37, 5, 3, 48, 32, config=MoeConfig(16, Tile(16, 16), Tile(16, 32)))

    @pytest.mark.parametrize("one_program", [True, False])
    def test_fused_moe_align_paths(one_program):
        """600 slots over 33 experts (BLOCK_E 64, 128-slot chunks): five chunks through
        either align path, an expert map, end to end."""
        moe.check_fused_moe(DEV, torch.float32, 300, 40, 2, 48, 40, local=(5, 33), one_program=one_program,
                           config=MoeConfig(16, Tile(32, 64), Tile(64, 64)))

    @pytest.mark.parametrize("case", moe.ROUTER_CASES, ids=lambda c: f"{c[0]}-e{c[1]}-g{c[2]}-k{c[4]}")
    def test_moe_route_m1(case):
        moe.check_moe_route(DEV, *case)

    @pytest.mark.parametrize("case", moe.ROUTER_CASES[::3], ids=lambda c: f"{c[0]}-e{c[1]}-k{c[4]}")
    def test_moe_route_m1_shared_columns(case):
        moe.check_moe_route(DEV, *case, shared=2)

    @pytest.mark.parametrize("case", moe.ROUTER_CASES, ids=lambda c: f"{c[0]}-e{c[1]}-g{c[2]}-k{c[4]}")
    @pytest.mark.parametrize("tokens", [5, 40])  # logits in the kernel, from a GEMM
    def test_moe_route_rows(case, tokens):
        moe.check_moe_route_rows(DEV, *case, tokens=tokens, shared=1)

    @pytest.mark.parametrize("one_program", [True, False, None])
    @pytest.mark.parametrize("block_m", [1, 16, 64])
    @pytest.mark.parametrize(
        "tokens,local,top_k,experts,first",
        [(1, 7, 2, None, 0), (37, 5, 3, None, 0), (37, 3, 3, 7, 2), (300, 33, 2, 40, 5), (400, 5, 3, None, 0),
         (50, 64, 6, None, 0), (3, 2, 2, 8, 6)],
    )
    def test_moe_align(one_program, block_m, tokens, local, top_k, experts, first):
        """Exact outputs of moe_align (order, padding, block experts, total) on both
        paths, several chunks (300 x 2 and 400 x 3 slots in 64-slot chunks), experts with
        no slots, a rank whose experts are at the end of the range."""
        moe.check_moe_align(DEV, tokens, local, top_k, block_m, num_experts=experts, first=first,
                           one_program=one_program, id_dtype=torch.int64 if tokens % 2 else torch.int32)

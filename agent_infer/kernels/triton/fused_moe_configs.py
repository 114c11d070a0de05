"""Launch configurations of the fused-MoE kernels (`fused_moe.py` beside this file), per
shape family (E_local, I_local, D) and bucket of tokens per step.

    The V2-Lite EP = 1 entries, its routed experts alone (`--quick`) and with the shared
    experts joined (every candidate), were measured on an H200
    (`benchmarks/tune_fused_moe.py`, 2026-12-01). The joined family (66 stored experts)
    serves steps of up to layers/moe.py's FUSED_SHARED_MAX_TOKENS only, so its table
    ends at that bucket. Other shape families (V2-Lite's EP = 2 and TP = 2 shards among
    them, to be measured on two GPUs) take `default_config`'s heuristic until the script,
    which prints a table in this file's format (see `format_table`), has run for them.

Why these knobs. At decode sizes the kernels stream the touched experts' weights from
HBM and the arithmetic is nearly free, so a configuration is good when many programs
are in flight, each with long contiguous weight loads: BLOCK_M stays at the tl.dot
minimum of 16 (or 1: the FMA rows path, one slot per block, no padding) and BLOCK_N
small, so that even 6 experts give hundreds of programs. With hundreds of tokens per
expert (prefill) the kernels are compute-bound and want large tensor-core tiles. The two
GEMMs have their own tiles (GEMM 1 is [T*k, D] x [D, 2I], GEMM 2 [T*k, I] x [I, D]);
BLOCK_M is shared because both walk the same expert-sorted, padded slot list.

Pure data and Python: importable without triton (the tuning script and CPU tests read it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Tile:
    """One grouped GEMM's tile over (N, K) and its launch shape."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeConfig:
    """block_m: slots per block (1 = FMA rows, else >= 16 for tl.dot); up: GEMM 1 (gate
    and up rows + SiLU-and-mul); down: GEMM 2 (down rows x routed weight)."""

    block_m: int
    up: Tile
    down: Tile


# Tokens-per-step buckets; a step of T tokens takes the first bucket >= T (the last one
# beyond it).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

# (E_local, I_local, D) -> {bucket: config}, measured (see above): DeepSeek-V2-Lite's
# routed experts whole (EP = 1, TP = 1), and Qwen3-30B-A3B's at one token (its other
# buckets take the heuristic).
TUNED: dict[tuple[int, int, int], dict[int, MoeConfig]] = {
    (128, 768, 2048): {  # Qwen3-30B-A3B, EP = 1; measured: H100, torch 2.11, 2026-12-05 (--tokens 1)
        1: MoeConfig(1, Tile(2, 1024, 4, 2), Tile(16, 128, 4, 3)),
    },
    (64, 1408, 2048): {  # V2-Lite, EP = 1; measured: H200, torch 2.11, 2026-12-01 (tune_fused_moe.py --quick)
        1: MoeConfig(16, Tile(64, 128, 4, 4), Tile(32, 128, 4, 4)),
        2: MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
        4: MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
        8: MoeConfig(16, Tile(32, 128, 4, 4), Tile(64, 128, 4, 4)),
        16: MoeConfig(16, Tile(32, 128, 4, 4), Tile(64, 128, 4, 4)),
        32: MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
        64: MoeConfig(16, Tile(32, 128, 4, 4), Tile(64, 128, 4, 4)),
        128: MoeConfig(32, Tile(64, 128, 4, 3), Tile(64, 128, 4, 3)),
        256: MoeConfig(64, Tile(64, 64, 4, 3), Tile(128, 64, 4, 3)),
        512: MoeConfig(64, Tile(64, 64, 4, 3), Tile(128, 64, 4, 3)),
        1024: MoeConfig(128, Tile(128, 64, 8, 4), Tile(128, 64, 8, 3)),
        4096: MoeConfig(128, Tile(128, 64, 8, 3), Tile(128, 64, 8, 3)),
    },
    (66, 1408, 2048): {  # V2-Lite, EP = 1, 2 shared experts joined; measured: H200, torch 2.11, 2026-12-01
        1: MoeConfig(1, Tile(2, 1024, 4, 2), Tile(16, 128, 4, 3)),  # H100, 2026-12-05 (--tokens 1)
        2: MoeConfig(16, Tile(32, 128, 4, 4), Tile(64, 64, 4, 4)),
        4: MoeConfig(16, Tile(32, 256, 4, 3), Tile(64, 128, 4, 4)),
        8: MoeConfig(16, Tile(32, 256, 4, 3), Tile(64, 128, 4, 4)),
        16: MoeConfig(16, Tile(32, 256, 4, 3), Tile(64, 128, 4, 4)),
        32: MoeConfig(16, Tile(32, 256, 4, 3), Tile(64, 128, 4, 4)),
        64: MoeConfig(32, Tile(64, 128, 4, 3), Tile(64, 64, 4, 4)),
        128: MoeConfig(32, Tile(128, 64, 4, 3), Tile(64, 64, 4, 4)),
        256: MoeConfig(64, Tile(64, 64, 4, 3), Tile(128, 64, 4, 3)),
        512: MoeConfig(64, Tile(64, 64, 4, 3), Tile(128, 64, 4, 3)),
        1024: MoeConfig(128, Tile(128, 64, 8, 4), Tile(128, 64, 8, 3)),
    },
}


# The same for e4m3 experts (`tune_fused_moe.py --weights fp8`), whose one-slot blocks
# read the weights as int32 words (fused_moe.py): a block_m = 1 tile is then BLOCK_N rows
# by BLOCK_K values a load. Buckets not listed fall back to `fp8_rows_config` at one
# token and to the bf16 entries beyond.
TUNED_FP8: dict[tuple[int, int, int], dict[int, MoeConfig]] = {
    (66, 1408, 2048): {  # V2-Lite, EP = 1, the 2 shared experts joined; measured: H200, torch 2.11, 2026-12-04
        1: MoeConfig(1, Tile(8, 1024, 4, 1), Tile(8, 512, 4, 2)),
    },
    (64, 1408, 2048): {  # V2-Lite, EP = 1; measured: H200, torch 2.11, 2026-12-04
        1: MoeConfig(1, Tile(8, 1024, 4, 1), Tile(16, 512, 4, 1)),
    },
    (128, 768, 2048): {  # Qwen3-30B-A3B, EP = 1
        1: MoeConfig(1, Tile(8, 512, 4, 2), Tile(16, 256, 4, 2)),  # NVIDIA H100 80GB HBM3, torch 2.11, 2026-12-06
    },
}


def bucket(tokens: int) -> int:
    """The bucket a step of `tokens` tokens takes its configuration from."""
    for b in BUCKETS:
        if tokens <= b:
            return b
    return BUCKETS[-1]


def default_config(tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """The heuristic for shapes without a TUNED entry, from the expected slots per expert
    under uniform routing (`num_experts` is the global count: under EP a rank sees the
    same density over its share). A best guess pending measurement, like TUNED."""
    per_expert = tokens * top_k / max(1, num_experts)
    if per_expert < 1:  # decode: few tokens on most experts, weight streaming
        return MoeConfig(16, Tile(32, 128, 4, 4), Tile(32, 128, 4, 4))
    if per_expert < 8:
        return MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4))
    if per_expert < 24:
        return MoeConfig(32, Tile(64, 128, 4, 3), Tile(64, 128, 4, 3))
    if per_expert < 64:
        return MoeConfig(64, Tile(64, 64, 4, 3), Tile(128, 64, 4, 3))
    return MoeConfig(128, Tile(64, 64, 8, 4), Tile(128, 64, 8, 4))


def _words_tile(rows: int, k: int, num_warps: int = 4) -> Tile:
    """`rows` rows by up to 2,048 values a load, the largest power of two that divides K
    when one of at least 512 does (whole tiles, no masks), else one covering K in as few
    masked tiles as a 2,048-value load allows."""
    block_k = 2048
    while k % block_k and block_k > 512:
        block_k //= 2
    if k % block_k:
        block_k = min(2048, 1 << (k - 1).bit_length())
    return Tile(rows, block_k, num_warps, 1)


def fp8_rows_config(inter: int, hidden: int) -> MoeConfig:
    """One token over e4m3 experts: one slot a block, the weights read as words like the
    dense fp8 GEMV (gemv.row_config's fp8 shapes: 4 gate/up row pairs, 8 down rows)."""
    return MoeConfig(1, _words_tile(4, hidden), _words_tile(8, inter))


def get_config(
    num_local_experts: int, inter: int, hidden: int, tokens: int, top_k: int, num_experts: int | None = None,
    fp8: bool = False,
) -> MoeConfig:
    """The configuration for a step of `tokens` tokens over experts of shape family
    (num_local_experts, inter, hidden); `num_experts` is the global expert count (the
    local one when None); `fp8`: e4m3 experts (one token reads them as int32 words when
    both GEMMs' K are whole words, else in tensor-core tiles like bf16 ones)."""
    key, b = (num_local_experts, inter, hidden), bucket(tokens)
    if fp8:
        if b in TUNED_FP8.get(key, {}):
            return TUNED_FP8[key][b]
        if tokens == 1 and hidden % 4 == 0 and inter % 4 == 0:  # rows of whole int32 words
            return fp8_rows_config(inter, hidden)
    family = TUNED.get(key)
    if family is not None and b in family:
        return family[b]
    return default_config(tokens, top_k, num_experts or num_local_experts)


def _low_bit(n: int) -> int:
    return n & -n


def takes_blocks(block: tuple[int, int] | None) -> bool:
    """Whether the fused MoE's GEMMs take e4m3 experts with these block scales as they
    are (None: one scale per row, always): a tensor-core K step, 16 columns at least,
    must lie in one block of columns (its weight tile takes one scale per column)."""
    return block is None or _low_bit(block[1]) >= 16


def fit_blocks(cfg: MoeConfig, block: tuple[int, int] | None) -> MoeConfig:
    """`cfg` with tiles that never straddle a scale block: FMA rows (block_m 1) of BLOCK_N
    rows within one block of rows (the tile's scale row is its first row's), tensor-core
    K steps within one block of columns (the step's weight tile takes one scale per
    column).
    Per-row scales and full-precision experts take any tile."""
    if block is None:
        return cfg
    if cfg.block_m == 1:
        def fit(t: Tile) -> Tile:
            return replace(t, block_n=min(t.block_n, _low_bit(block[0])))
    else:
        def fit(t: Tile) -> Tile:
            return replace(t, block_k=min(t.block_k, _low_bit(block[1])))
    return replace(cfg, up=fit(cfg.up), down=fit(cfg.down))


def format_tile(t: Tile) -> str:
    return f"Tile({t.block_n}, {t.block_k}, {t.num_warps}, {t.num_stages})"


def format_config(c: MoeConfig) -> str:
    return f"MoeConfig({c.block_m}, {format_tile(c.up)}, {format_tile(c.down)})"


def format_table(table: dict[tuple[int, int, int], dict[int, MoeConfig]], notes: dict | None = None,
                 name: str = "TUNED") -> str:
    """`table` as the `TUNED = {...}` block of this file (`name`: or TUNED_FP8; what the
    tuning script prints; `notes` maps a family to the comment after its key)."""
    lines = [f"{name}: dict[tuple[int, int, int], dict[int, MoeConfig]] = {{"]
    for family, configs in table.items():
        note = (notes or {}).get(family)
        lines.append(f"    {family}: {{" + (f"  # {note}" if note else ""))
        for b, c in sorted(configs.items()):
            lines.append(f"        {b}: {format_config(c)},")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)

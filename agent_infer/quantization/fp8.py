"""fp8 (e4m3) weights as checkpoints publish them, and their reference arithmetic.

Two layouts are in use:
- **block** (DeepSeek-V3/R1, Qwen3-*-FP8): `quant_method: fp8`, e4m3 weights with one
  float32 scale per `weight_block_size` block (128 x 128) in `<name>.weight_scale_inv`;
  despite the name it multiplies: w ~ w_fp8 * scale. Activations are quantized at run
  time per token and per group of `block[1]` input features (`activation_scheme:
  dynamic`).
- **channel** (llm-compressor's compressed-tensors FP8): one scale per output row in
  `<name>.weight_scale` ([N, 1]), activations quantized per token at run time.

Scales are absmax / 448 (e4m3's largest finite value), so every block's largest element
lands on the format's top; an all-zero block gets scale 1 (its values stay 0). These
functions are the definition the loader and the kernels are checked against: quantize
exactly as the format stores a weight, dequantize it, and the W8A8 product in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agent_infer.checkpoint_files import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


@dataclass(frozen=True)
class Fp8Config:
    """A checkpoint's fp8 scheme, read from its `quantization_config`."""

    layout: str  # "block" | "channel"
    block: tuple[int, int] | None  # (rows, columns) of a weight block; None for "channel"
    ignored: tuple[str, ...] = ()  # module names left unquantized (besides embeddings, norms, gates)
    # True: a full-precision checkpoint quantized as it loads (`--quantization fp8`), so every
    # projection that can be is fp8; False: the checkpoint's own fp8 weights say which are.
    online: bool = False

    @staticmethod
    def online_channel() -> "Fp8Config":
        """`--quantization fp8`: e4m3 weights with one scale per output row, activations
        quantized per token at run time (compressed-tensors' FP8-dynamic scheme). Per row
        rather than per block, so any shape and any tensor-parallel split quantizes."""
        return Fp8Config("channel", None, online=True)

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """The scales of an [n, k] weight: one per block, or one per row."""
        if self.layout == "channel":
            return (n, 1)
        return (-(-n // self.block[0]), -(-k // self.block[1]))

    @staticmethod
    def from_hf(quant: dict[str, Any] | None) -> "Fp8Config | None":
        """The scheme of a config.json's `quantization_config` (None: not quantized).
        Raises ConfigError naming what is not supported."""
        if not quant:
            return None
        if not isinstance(quant, dict):
            raise ConfigError(f"quantization_config must be an object, not {type(quant).__name__}")
        method = quant.get("quant_method")
        if method == "fp8":
            return _block_config(quant)
        if method == "compressed-tensors":
            return _channel_config(quant)
        raise ConfigError(f"quantization_config quant_method {method!r} is not supported; fp8 checkpoints "
                          f"(quant_method 'fp8' with weight_block_size, or compressed-tensors FP8) are")


def _block_config(quant: dict[str, Any]) -> Fp8Config:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"fp8 format {fmt!r} is not supported (e4m3 only)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"fp8 activation_scheme {quant['activation_scheme']!r} is not supported (dynamic only)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"fp8 checkpoints need weight_block_size [rows, columns]; got {block!r} (per-tensor "
                          f"fp8 is not supported)")
    ignored = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ()
    return Fp8Config("block", (block[0], block[1]), tuple(ignored))


def _channel_config(quant: dict[str, Any]) -> Fp8Config:
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"compressed-tensors checkpoints with {len(groups)} config groups are not supported (one)")
    (group,) = groups.values()
    weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
    wanted = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    found = {k: weights.get(k) for k in wanted}
    if found != wanted or weights.get("dynamic"):
        raise ConfigError(f"compressed-tensors weights {found} are not supported; FP8 per-channel static weights "
                          f"({wanted}) are")
    if acts and not (acts.get("dynamic") and acts.get("strategy") == "token" and acts.get("num_bits") == 8):
        raise ConfigError("compressed-tensors input activations must be dynamic 8-bit per token")
    kv = quant.get("kv_cache_scheme")
    if kv:  # per-layer `self_attn.k_scale` / `v_scale`, applied by an fp8 KV cache
        wanted = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
        found = {k: kv.get(k) for k in wanted} | {"dynamic": bool(kv.get("dynamic"))}
        if found != wanted:
            raise ConfigError(f"compressed-tensors kv_cache_scheme {found} is not supported; static fp8 scales "
                              f"per tensor ({wanted}) are")
    return Fp8Config("channel", None, tuple(quant.get("ignore") or ()))


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # Divided by a tensor, not the Python float: on CUDA torch turns division by a scalar
    # into multiplication by its fp32 reciprocal, one ulp off the quotient in about half
    # the cases, which moves values across e4m3 rounding boundaries. A tensor divisor is
    # divided correctly rounded on every device, as the kernels do.
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [N, K] zero-padded to whole blocks, as [N / rows, rows, K / cols, cols]."""
    rows, cols = block
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % cols, 0, -n % rows))
    return padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 [N, K], scale [ceil(N / rows), ceil(K / cols)] float32) as the block layout
    stores a weight; the last row and column of blocks may be partial."""
    n, k = w.shape
    tiles = _blocks(w.float(), block)
    scale = _scales(tiles.abs().amax(dim=(1, 3)))
    q = _to_fp8(tiles / scale[:, None, :, None])
    return q.view(tiles.shape[0] * block[0], -1)[:n, :k].contiguous(), scale


def dequantize_block(w_fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight a block-fp8 tensor stands for: each element times its block's scale."""
    return dequantize(w_fp8, scale, Fp8Config("block", block), dtype)


def quantize_experts(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert matrices [E, N, K] in the block layout, each expert's matrix on its
    own as a checkpoint stores it: (e4m3 values [E, N, K], scales [E, ceil(N / rows),
    ceil(K / columns)])."""
    pairs = [quantize_block(m, block) for m in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 [N, K], scale [N, 1] float32): compressed-tensors' per-channel FP8."""
    scale = _scales(w.float().abs().amax(dim=1, keepdim=True))
    return _to_fp8(w.float() / scale), scale


def dequantize_channel(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize(w_fp8, scale, Fp8Config("channel", None), dtype)


def check_block_slice(config: Fp8Config, shape: tuple[int, ...], dim: int, start: int, length: int,
                      what: str) -> None:
    """Raise ValueError unless rows (dim 0) or columns (dim 1) [start, start + length)
    of an fp8 tensor of `shape` begin on a block boundary and end on one or at the
    tensor's end: a slice's values and their scales must be whole blocks. Per-row
    scales split anywhere."""
    if config.layout == "channel":
        return
    size = config.block[dim]
    end = start + length
    if start % size or (end % size and end != shape[dim]):
        unit = "rows" if dim == 0 else "columns"
        raise ValueError(
            f"{unit} {start}..{end} of this [{shape[0]}, {shape[1]}] fp8 weight (a tensor-parallel rank's {what}, "
            f"or one projection of a merged weight) would split its {config.block[0]} x {config.block[1]} "
            f"blocks (weight_block_size): each must start and end on a multiple of {size} {unit}")


def quantize(w: torch.Tensor, config: Fp8Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, scale) for w [N, K] in `config`'s layout."""
    return quantize_block(w, config.block) if config.layout == "block" else quantize_channel(w)


def dequantize(w_fp8: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return Fp8Weight("weight", w_fp8, scale, config).load().to(dtype)


def fp8_slice(loaded, dim: int, start: int, size: int, config: Fp8Config,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (dim 0) or columns (dim 1) [start, start + size) of a checkpoint tensor (a
    tensor, a lazy handle or an `Fp8Weight`) in `config`'s fp8 form: (e4m3 values,
    scales). An fp8 tensor of that layout gives its stored values (`Fp8Weight.raw`);
    anything else is quantized on `device`, where a column slice under per-row scales
    quantizes the whole rows first, so any split holds the values one piece holds. A
    tensor whose extent along `dim` is `size` is the slice itself."""
    if tuple(loaded.shape)[dim] == size:
        start = 0
    if isinstance(loaded, Fp8Weight) and loaded.config.layout == config.layout and loaded.config.block == config.block:
        return loaded.raw(dim, start, size)
    whole_rows = dim == 1 and config.layout == "channel"
    part = loaded if whole_rows or tuple(loaded.shape)[dim] == size else loaded.narrow(dim, start, size)
    part = part if isinstance(part, torch.Tensor) else part.load()
    q, scale = quantize(part.to(device, torch.float32), config)
    return (q.narrow(1, start, size), scale) if whole_rows else (q, scale)


def quantize_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [T, K] -> (x_fp8 [T, K], scale [T, ceil(K / group)]),
    one scale per token and group of `group` features (per token: group >= K)."""
    t, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(t, -1, group)
    scale = _scales(padded.abs().amax(dim=2))
    q = _to_fp8(padded / scale[:, :, None])
    return q.view(t, -1)[:, :k].contiguous(), scale


def dequantize_token_groups(x_fp8: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The values `quantize_token_groups` stands for, in fp32: each e4m3 element times its
    token's scale for its group of `group` features."""
    return x_fp8.float() * scale.repeat_interleave(group, 1)[:, : x_fp8.shape[1]]


def w8a8_block_matmul(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                      quantize_activations: bool = True) -> torch.Tensor:
    """y = x W^T for a block-fp8 W, in fp32, returned in x's dtype. With
    `quantize_activations`, x is first quantized per token and per group of block[1]
    features, as the fp8 kernels run it; without, only the weight is fp8 (the CPU path,
    which equals a bf16/fp32 model holding the dequantized weight)."""
    w = dequantize_block(w_fp8, w_scale, block)
    xf = x.float()
    if quantize_activations:
        xf = dequantize_token_groups(*quantize_token_groups(xf, block[1]), block[1])
    return (xf @ w.t()).to(x.dtype)


# ---- checkpoints --------------------------------------------------------------------------


def is_fp8(w) -> bool:
    """A checkpoint tensor stored as e4m3 (a safetensors handle, or a tensor)."""
    stored = getattr(w, "stored_dtype", None)
    return stored == "F8_E4M3" if stored is not None else getattr(w, "dtype", None) == FP8


class Fp8Weight:
    """A checkpoint's fp8 weight with its scales, read as the float32 weight they stand
    for: whole (`load`) or a tensor-parallel slice (`narrow`), which reads only the rows
    or columns of the slice and the scales of the blocks it touches."""

    def __init__(self, name: str, weight, scale, config: Fp8Config):
        self.name, self._weight, self._scale, self._config = name, weight, scale, config
        self.shape = tuple(weight.shape)
        if len(self.shape) != 2:
            raise ValueError(f"fp8 weight {name} has shape {list(self.shape)}; fp8 weights are 2-D")
        n, k = self.shape
        rows, cols = self.block = config.block if config.layout == "block" else (1, k)
        expected = (-(-n // rows), -(-k // cols))
        if tuple(scale.shape) not in (expected, expected[:1]):  # [N, 1] or [N] per channel
            raise ValueError(f"fp8 weight {name} of shape {[n, k]} needs scales of shape {list(expected)} (one per "
                             f"block of {rows} rows x {cols} columns), got {list(scale.shape)}")

    @property
    def config(self) -> Fp8Config:
        return self._config

    def load(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])

    def raw(self, dim: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored e4m3 values of rows (dim 0) or columns (dim 1) [start, start +
        length) and the scales that go with them, as stored: the blocks the slice
        covers (per-row scales: the slice's rows, or all rows for a column slice). A
        slice that would split a block raises ValueError saying so."""
        check_block_slice(self._config, self.shape, dim, start, length, "slice")
        w = self._weight.narrow(dim, start, length)
        w = w if isinstance(w, torch.Tensor) else w.load()
        scale = self._scale if isinstance(self._scale, torch.Tensor) else self._scale.load()
        scale = scale.float().reshape(-(-self.shape[0] // self.block[0]), -1)
        if self._config.layout == "channel":
            return w, (scale.narrow(0, start, length) if dim == 0 else scale)
        size = self._config.block[dim]
        return w, scale.narrow(dim, start // size, -(-length // size))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        w = self._weight.narrow(dim, start, length)
        w = w if isinstance(w, torch.Tensor) else w.load()
        scale = self._scale if isinstance(self._scale, torch.Tensor) else self._scale.load()
        scale = scale.float().reshape(-(-self.shape[0] // self.block[0]), -1)
        # The scales of the blocks the slice touches, spread over its elements.
        size = self.block[dim]
        first = start // size
        scale = scale.narrow(dim, first, -(-(start + length) // size) - first).repeat_interleave(size, dim)
        scale = scale.narrow(dim, start - first * size, length)
        other = 1 - dim
        scale = scale.repeat_interleave(self.block[other], other).narrow(other, 0, self.shape[other])
        return w.float() * scale


def dequantized(weights, config: Fp8Config):
    """The (name, weight) pairs of a checkpoint with each fp8 weight and its scale joined
    into one `Fp8Weight` under the weight's name; other tensors pass through. A weight
    without its scale, or a scale without its weight, is an error naming it."""
    suffix = ".weight_scale_inv" if config.layout == "block" else ".weight_scale"
    weights_waiting: dict[str, object] = {}
    scales_waiting: dict[str, object] = {}
    for name, w in weights:
        if name.endswith(suffix):
            base = name[: -len(suffix)] + ".weight"
            if base in weights_waiting:
                yield base, Fp8Weight(base, weights_waiting.pop(base), w, config)
            else:
                scales_waiting[base] = w
        elif is_fp8(w):
            if name in scales_waiting:
                yield name, Fp8Weight(name, w, scales_waiting.pop(name), config)
            else:
                weights_waiting[name] = w
        elif config.layout == "channel" and name.endswith(".input_scale"):
            continue  # a static activation scale; activations here are quantized per token
        else:
            yield name, w
    if weights_waiting:
        raise ConfigError(f"fp8 weight {sorted(weights_waiting)[0]} has no {suffix[1:]} in the checkpoint")
    if scales_waiting:
        raise ConfigError(f"{sorted(scales_waiting)[0][: -len('.weight')]}{suffix} has no fp8 weight beside it")

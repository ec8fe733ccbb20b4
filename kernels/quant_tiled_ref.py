"""The tile layout of int8 / int4 weights that kernels/quant_tiled.py reads, and its torch twin.

A *tile* is 16 output rows by 64 input features of the weight: the A operand of four
mma.sync m16n8k16 steps (16 input features each). It is stored as the 32 lanes of a warp hold it,
so each lane's A fragments for its mmas come from one 16-byte load (int4: all four steps; int8:
two steps a load, `CHUNKS` = 2 loads a tile):

- lane (g, t) = (lane // 4, lane % 4) holds, for step s and fragment register r (0..3), the values
  of output g + 8 (r & 1) at input features 16 s + 2 t + 8 (r >> 1) + {0, 1} (the PTX ISA's A
  placement; the pair's lower feature in the low half);
- int4: word s of the lane's 16 bytes holds step s, register r's pair as nibbles r (low feature)
  and r + 4 (high feature), so `(word >> 4 r) & 0x000F000F` isolates one pair;
- int8: chunk s // 2, word 2 (s % 2) + r // 2 holds registers r = 0, 1 (bytes 0-1, 2-3) and
  r = 2, 3, so a byte permute isolates one pair.
Each field is the value plus 2^(bits - 1), as compressed-tensors stores it.

`TiledWeight.tiles` is int32 [k_tiles, n_tiles, CHUNKS * 32 * 4]: tiles of one 64-feature column
next to one another, so a block's outputs at one K step are contiguous bytes. Outputs are padded to
whole tiles with zeros, input features likewise (a zero weight adds nothing). `TiledWeight.scales`
is float32 [num_groups, n_tiles, 8, 2]: entry (group, tile, g, h) is the scale of output
16 tile + g + 8 h, so lane (g, t) reads both of its outputs' scales in one 8-byte load. A group
holds whole tiles (group_size a multiple of 64) or is the whole row (one scale per output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant_ref import BITS, pack_int32, quant_linear_ref, unpack_int32

TILE_N = 16
"""Outputs of a tile (the m16 of the mma)."""
TILE_K = 64
"""Input features of a tile (four k16 mma steps)."""
LANE_WORDS = 4
"""32-bit words of one lane's 16-byte load."""
CHUNKS = {"int4": 1, "int8": 2}
"""16-byte loads a lane makes for one tile."""
IN_FEATURES_MULTIPLE = 8
"""Input features must be a multiple of this: x's rows are read 16 bytes (8 values) at a time."""


@dataclass(frozen=True)
class TiledWeight:
    """An int8 / int4 weight in the tile layout (module docstring), made once at load."""

    tiles: torch.Tensor  # int32 [k_tiles, n_tiles, CHUNKS * 32 * LANE_WORDS]
    scales: torch.Tensor  # float32 [num_groups, n_tiles, 8, 2]
    scheme: str  # int8 or int4
    out_features: int
    in_features: int
    group_size: int  # in_features for one scale per output

    @property
    def k_tiles(self) -> int:
        return self.tiles.shape[0]

    @property
    def n_tiles(self) -> int:
        return self.tiles.shape[1]

    @property
    def group_tiles(self) -> int:
        """Tiles of one K column a scale group spans (all of them for one scale per output)."""
        return self.k_tiles if self.scales.shape[0] == 1 else self.group_size // TILE_K


def check_tileable(scheme: str, out_features: int, in_features: int, group_size: int) -> None:
    """Raises ValueError (naming the rule) for a weight the tile layout cannot hold."""
    if scheme not in CHUNKS:
        raise ValueError(f"the tile layout holds int8 / int4 weights, not {scheme!r}")
    if out_features <= 0 or in_features <= 0 or in_features % IN_FEATURES_MULTIPLE:
        raise ValueError(
            f"tile layout: {out_features} x {in_features} needs a positive size and input features "
            f"a multiple of {IN_FEATURES_MULTIPLE}"
        )
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"tile layout: group size {group_size} does not divide {in_features} input features")
    if group_size != in_features and group_size % TILE_K:
        raise ValueError(
            f"tile layout: groups of {group_size} input features split a tile of {TILE_K}; "
            f"use a multiple of {TILE_K} or one scale per output"
        )


def lane_positions(scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input feature) within the tile of every stored field, each int64
    [CHUNKS, 32 lanes, LANE_WORDS, fields per word], fields from the low bits up."""
    chunks, fields = CHUNKS[scheme], 32 // BITS[scheme]
    rows = torch.empty(chunks, 32, LANE_WORDS, fields, dtype=torch.int64)
    cols = torch.empty_like(rows)
    for chunk in range(chunks):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for word in range(LANE_WORDS):
                for field in range(fields):
                    if scheme == "int4":
                        step, register, high = word, field % 4, field // 4
                    else:
                        step = 2 * chunk + word // 2
                        register, high = 2 * (word % 2) + field // 2, field % 2
                    rows[chunk, lane, word, field] = g + 8 * (register & 1)
                    cols[chunk, lane, word, field] = 16 * step + 2 * t + 8 * (register >> 1) + high
    return rows, cols


def _padded_values(qweight: torch.Tensor, scheme: str, n_tiles: int, k_tiles: int) -> torch.Tensor:
    """The weight's integers, int8 [n_tiles * TILE_N, k_tiles * TILE_K], zeros past its edges."""
    values = unpack_int32(qweight, BITS[scheme])
    padded = torch.zeros(n_tiles * TILE_N, k_tiles * TILE_K, dtype=torch.int8, device=qweight.device)
    padded[: values.shape[0], : values.shape[1]] = values
    return padded


def repack_tiles(
    qweight: torch.Tensor,  # int32 [out_features, in_features * bits / 32] (compressed-tensors)
    scale: torch.Tensor,  # float32 [out_features, num_groups]
    scheme: str,  # int8 or int4
) -> TiledWeight:
    """The tile layout of a compressed-tensors weight, on its device (torch ops only); ValueError
    for a weight it cannot hold (`check_tileable`) or tensors that are not such a weight."""
    if scheme not in CHUNKS:
        raise ValueError(f"the tile layout holds int8 / int4 weights, not {scheme!r}")
    if qweight.dim() != 2 or qweight.dtype != torch.int32 or scale.dim() != 2 or scale.dtype != torch.float32:
        raise ValueError(
            f"tile layout: weight {tuple(qweight.shape)} {qweight.dtype} and scale {tuple(scale.shape)} "
            f"{scale.dtype} are not a compressed-tensors int32 weight with float32 scales"
        )
    bits = BITS[scheme]
    out_features, in_features = qweight.shape[0], qweight.shape[1] * 32 // bits
    num_groups = scale.shape[1]
    if scale.shape[0] != out_features or num_groups == 0 or in_features % num_groups:
        raise ValueError(
            f"tile layout: scale {tuple(scale.shape)} does not fit weight {tuple(qweight.shape)}"
        )
    check_tileable(scheme, out_features, in_features, in_features // num_groups)
    n_tiles, k_tiles = -(-out_features // TILE_N), -(-in_features // TILE_K)
    values = _padded_values(qweight, scheme, n_tiles, k_tiles)
    by_tile = values.view(n_tiles, TILE_N, k_tiles, TILE_K).permute(2, 0, 1, 3)  # [kt, nt, 16, 64]
    rows, cols = (p.to(qweight.device) for p in lane_positions(scheme))
    fields = by_tile[:, :, rows, cols]  # [kt, nt, chunks, 32, words, fields]
    words = pack_int32(fields.reshape(-1, fields.shape[-1]), bits)  # [..., 1]
    tiles = words.view(k_tiles, n_tiles, -1).contiguous()
    padded_scale = torch.zeros(n_tiles * TILE_N, num_groups, dtype=torch.float32, device=scale.device)
    padded_scale[:out_features] = scale
    scales = padded_scale.t().reshape(num_groups, n_tiles, 2, 8).transpose(2, 3).contiguous()
    return TiledWeight(tiles, scales, scheme, out_features, in_features, in_features // num_groups)


def unpack_tiles(tiled: TiledWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `repack_tiles`: (compressed-tensors int32 weight, float32 scale)."""
    bits = BITS[tiled.scheme]
    k_tiles, n_tiles = tiled.k_tiles, tiled.n_tiles
    rows, cols = (p.to(tiled.tiles.device) for p in lane_positions(tiled.scheme))
    fields = unpack_int32(tiled.tiles.reshape(-1, 1), bits).view(k_tiles, n_tiles, *rows.shape)
    by_tile = torch.zeros(k_tiles, n_tiles, TILE_N, TILE_K, dtype=torch.int8, device=tiled.tiles.device)
    by_tile[:, :, rows, cols] = fields
    values = by_tile.permute(1, 2, 0, 3).reshape(n_tiles * TILE_N, k_tiles * TILE_K)
    values = values[: tiled.out_features, : tiled.in_features]
    num_groups = tiled.scales.shape[0]
    scale = tiled.scales.transpose(2, 3).reshape(num_groups, n_tiles * TILE_N).t()[: tiled.out_features]
    return pack_int32(values, bits), scale.contiguous()


def tiled_linear_ref(
    x: torch.Tensor,  # [num_rows, in_features]
    tiled: TiledWeight,
    bias: torch.Tensor | None = None,  # [out_features]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_rows, out_features]
    """The torch twin of `quant_tiled_cuda`: `quant_linear_ref` of the unpacked weight."""
    qweight, scale = unpack_tiles(tiled)
    return quant_linear_ref(x, qweight, scale, tiled.scheme, bias, out_dtype)

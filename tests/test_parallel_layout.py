"""Single-process pieces of the parallel package: layouts, sequence shards, decode bands and halos (tables), the
text-projection memo, and the generator refusing impossible layouts."""

from __future__ import annotations

import re

import pytest
import torch

from distvideo.errors import ConfigError
from distvideo.parallel.cfg import texts_for_branch
from distvideo.parallel.layout import ParallelLayout, resolve_layout, valid_layouts
from distvideo.parallel.ulysses import SequenceShard, pad_dim, take_shard
from distvideo.parallel.vae import conv_row_halo, decode_band_count, split_rows

# --- layouts ----------------------------------------------------------------------------------------------------------

# (world, sp_size, cfg_parallel, heads) -> (cfg_degree, sp_size)
LAYOUTS = [
    (1, None, None, 4, (1, 1)),
    (2, None, None, 4, (2, 1)),  # even world: CFG parallel by default
    (4, None, None, 4, (2, 2)),
    (8, None, None, 12, (2, 4)),
    (3, None, None, 3, (1, 3)),  # odd world: all ranks in one SP group
    (2, 2, None, 4, (1, 2)),  # sp = world: CFG off
    (4, 2, None, 4, (2, 2)),  # sp = world / 2: CFG on
    (2, None, False, 4, (1, 2)),
    (4, None, True, 4, (2, 2)),
    (4, 4, False, 4, (1, 4)),
    (2, 1, True, 4, (2, 1)),
    (1, 1, False, None, (1, 1)),
]


@pytest.mark.parametrize(("world", "sp", "cfg", "heads", "expected"), LAYOUTS)
def test_resolve_layout(world, sp, cfg, heads, expected):
    layout = resolve_layout(world, sp_size=sp, cfg_parallel=cfg, num_heads=heads)
    assert (layout.cfg_degree, layout.sp_size) == expected
    assert layout.cfg_degree * layout.sp_size == world


# (world, sp_size, cfg_parallel, heads) -> every fragment the message must contain
LAYOUT_ERRORS = [
    (4, 3, None, 12, ["cfg(1) * sp(3) = 3 != world_size(4)", "sp_size=2, cfg_parallel=True", "sp_size=4"]),
    (3, None, True, 4, ["cfg_parallel=True needs an even world size", "world_size(3)"]),
    (2, 2, True, 4, ["cfg(2) * sp(2) = 4 != world_size(2)", "sp_size=1, cfg_parallel=True"]),
    (4, 8, None, 8, ["cfg(1) * sp(8) = 8 != world_size(4)"]),
    (2, 0, None, 4, ["sp_size(0) must be >= 1"]),
    (5, 2, False, 4, ["cfg(1) * sp(2) = 2 != world_size(5)", "sp_size=5, cfg_parallel=False"]),
]


@pytest.mark.parametrize(("world", "sp", "cfg", "heads", "fragments"), LAYOUT_ERRORS)
def test_layout_errors_show_the_numbers(world, sp, cfg, heads, fragments):
    with pytest.raises(ConfigError) as info:
        resolve_layout(world, sp_size=sp, cfg_parallel=cfg, num_heads=heads)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


# USP: (world, keyword arguments) -> (cfg, ulysses, ring); with only sp, Ulysses takes the largest divisor of the
# heads that divides sp and ring attention the rest, so a head count that sp does not divide is no longer refused
USP_LAYOUTS = [
    (4, dict(num_heads=3), (2, 1, 2)),
    (6, dict(num_heads=4), (2, 1, 3)),
    (8, dict(num_heads=6, cfg_parallel=False), (1, 2, 4)),
    (8, dict(num_heads=12), (2, 4, 1)),  # Ulysses alone where it fits: today's layouts unchanged
    (4, dict(num_heads=4, cfg_parallel=False, ring_size=4), (1, 1, 4)),
    (4, dict(num_heads=4, ulysses_size=2, ring_size=2), (1, 2, 2)),  # both given: sp = 4, cfg follows
    (8, dict(num_heads=4, cfg_parallel=True, ulysses_size=2), (2, 2, 2)),
    (4, dict(num_heads=4, sp_size=2, ring_size=2), (2, 1, 2)),
    (2, dict(num_heads=4, ring_size=2), (1, 1, 2)),  # automatic CFG would leave sp 1: off
    (4, dict(num_heads=4, ring_size=2), (2, 1, 2)),
    (4, dict(num_heads=4, ring_size=4), (1, 1, 4)),
]


@pytest.mark.parametrize(("world", "kwargs", "expected"), USP_LAYOUTS)
def test_usp_layouts(world, kwargs, expected):
    layout = resolve_layout(world, **kwargs)
    assert (layout.cfg_degree, layout.ulysses_size, layout.ring_size) == expected
    assert layout.ulysses_size * layout.ring_size == layout.sp_size


USP_ERRORS = [
    (4, dict(sp_size=4, ulysses_size=2, ring_size=1), "ulysses_size(2) * ring_size(1) = 2 != sp_size(4)"),
    (4, dict(ring_size=0), "ring_size(0) must be >= 1"),
    (4, dict(ulysses_size=-1), "ulysses_size(-1) must be >= 1"),
    (4, dict(cfg_parallel=False, ring_size=3), "ring_size(3) must divide sp_size(4)"),
    (4, dict(num_heads=3, sp_size=4, ulysses_size=2), "ulysses_size(2) must divide the model's attention heads(3)"),
]


@pytest.mark.parametrize(("world", "kwargs", "fragment"), USP_ERRORS)
def test_usp_errors_name_the_option(world, kwargs, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        resolve_layout(world, **kwargs)


def test_usp_rank_order():
    layout = ParallelLayout(world_size=8, sp_size=4, cfg_degree=2, ring_size=2)
    # sp_rank = ring_rank * ulysses + ulysses_rank: Ulysses pairs contiguous, ring pairs ulysses_size apart
    assert [(layout.ring_rank(r), layout.ulysses_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.describe() == "world 8 = cfg 2 x sp 4 (ulysses 2 x ring 2)"


def test_layout_rank_order_and_groups():
    layout = ParallelLayout(world_size=8, sp_size=4, cfg_degree=2)
    assert layout.sp_group_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.cfg_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # rank = cfg_rank * sp + sp_rank
    assert [(layout.cfg_rank(r), layout.sp_rank(r)) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]


def test_valid_layouts():
    assert valid_layouts(4, 4) == [(2, 2), (1, 4)]
    assert valid_layouts(6, 4) == [(2, 3), (1, 6)]  # ring attention takes what the heads do not divide
    assert valid_layouts(3) == [(1, 3)]


def test_texts_for_branch():
    assert texts_for_branch(0, True) == (True, False)
    assert texts_for_branch(1, True) == (False, True)
    assert texts_for_branch(0, False) == texts_for_branch(1, False) == (True, False)


# --- sequence shards --------------------------------------------------------------------------------------------------

# (seq_len, sp, rank) -> (padded_len, local_len, start, real_local_len)
SHARDS = [
    (48, 2, 0, (48, 24, 0, 24)),
    (48, 2, 1, (48, 24, 24, 24)),
    (27, 2, 0, (28, 14, 0, 14)),
    (27, 2, 1, (28, 14, 14, 13)),
    (5, 4, 3, (8, 2, 6, 0)),  # a shard made only of padding
    (5, 4, 2, (8, 2, 4, 1)),
    (1, 1, 0, (1, 1, 0, 1)),
]


@pytest.mark.parametrize(("seq_len", "sp", "rank", "expected"), SHARDS)
def test_sequence_shard(seq_len, sp, rank, expected):
    shard = SequenceShard(seq_len, sp, rank)
    assert (shard.padded_len, shard.local_len, shard.start, shard.real_local_len) == expected
    assert shard.pad == shard.padded_len - seq_len < sp


def test_shards_reassemble_the_sequence():
    x = torch.arange(2 * 27 * 3).reshape(2, 27, 3)
    pieces = [take_shard(x, 1, SequenceShard(27, 4, r)) for r in range(4)]
    assert all(p.shape == (2, 7, 3) for p in pieces)
    assert torch.equal(torch.cat(pieces, 1)[:, :27], x)
    assert torch.equal(pad_dim(x, 1, 27), x)
    with pytest.raises(ValueError):
        pad_dim(x, 1, 26)


@pytest.mark.parametrize(("seq_len", "sp", "rank"), [(0, 2, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_bad_shards(seq_len, sp, rank):
    with pytest.raises(ValueError):
        SequenceShard(seq_len, sp, rank)


# --- decode bands -----------------------------------------------------------------------------------------------------

SPLITS = [
    (8, 2, [(0, 4), (4, 8)]),
    (7, 2, [(0, 4), (4, 7)]),
    (6, 4, [(0, 2), (2, 4), (4, 5), (5, 6)]),
    (24, 3, [(0, 8), (8, 16), (16, 24)]),
    (3, 1, [(0, 3)]),
]


@pytest.mark.parametrize(("rows", "bands", "expected"), SPLITS)
def test_split_rows(rows, bands, expected):
    assert split_rows(rows, bands) == expected


@pytest.mark.parametrize(("rows", "bands"), [(3, 4), (5, 0)])
def test_split_rows_refuses_empty_bands(rows, bands):
    with pytest.raises(ValueError):
        split_rows(rows, bands)


# (latent rows, world, min rows) -> ranks that decode
BAND_COUNTS = [
    (24, 2, 2, 2),
    (8, 4, 2, 4),
    (6, 4, 2, 3),  # falls back to the first 3 ranks
    (3, 2, 2, 1),  # too small: one rank decodes
    (60, 8, 2, 8),
    (5, 1, 2, 1),
    (8, 4, 4, 2),
]


@pytest.mark.parametrize(("rows", "world", "min_rows", "expected"), BAND_COUNTS)
def test_decode_band_count(rows, world, min_rows, expected):
    assert decode_band_count(rows, world, min_rows) == expected


@pytest.mark.parametrize(("kernel", "stride", "padding", "halo"), [(3, 1, 1, 1), (5, 1, 2, 2), (1, 1, 0, 0)])
def test_conv_row_halo(kernel, stride, padding, halo):
    assert conv_row_halo(kernel, stride, padding) == halo


@pytest.mark.parametrize(("kernel", "stride", "padding"), [(3, 2, 1), (3, 1, 0)])
def test_conv_row_halo_refuses_non_same_convolutions(kernel, stride, padding):
    with pytest.raises(ValueError, match="stride-1 'same'"):
        conv_row_halo(kernel, stride, padding)


# --- the generator refuses impossible layouts before loading anything -------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(executor="inline", sp_size=2), "cfg(1) * sp(2) = 2 != world_size(1)"),
        (dict(executor="inline", cfg_parallel=True), "cfg_parallel=True needs an even world size"),
        (dict(executor="mp", num_gpus=4, sp_size=4, ulysses_size=4, ring_size=2), "ulysses_size=4 x ring_size=2"),
        (dict(executor="mp", num_gpus=4, ring_size=0), "ring_size=0 must be a whole number >= 1"),
        (dict(executor="mp", num_gpus=4, sp_size=3), "cfg(1) * sp(3) = 3 != world_size(4)"),
    ],
)
def test_generator_refuses_impossible_layouts_before_loading(tiny_model, kwargs, fragment):
    from distvideo import VideoGenerator

    with pytest.raises(ConfigError, match=re.escape(fragment)):
        VideoGenerator.from_pretrained(tiny_model, **kwargs)


# --- text projections reused across steps -----------------------------------------------------------------------------


def test_input_memo_reuses_only_the_same_unchanged_tensor():
    from collections import Counter

    from distvideo.families.wan.text_padding import InputMemo

    layer = torch.nn.Linear(4, 3)
    counts: Counter[str] = Counter()
    memo = InputMemo(layer, counts)
    a, b, c = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    with torch.no_grad():
        first = layer(a)
        assert layer(a) is first and layer(b) is not first and layer(a) is first  # two entries: a and b
        layer(c)  # evicts a
        assert layer(a) is not first
        again = layer(a)
        a.mul_(2)  # changed in place: recomputed
        assert layer(a) is not again and torch.allclose(
            layer(a), torch.nn.functional.linear(a, layer.weight, layer.bias)
        )
    assert counts["text_projection_reused"] == 4
    assert layer(a) is not layer(a)  # autograd on: never reused
    memo.remove()
    assert "forward" not in vars(layer)

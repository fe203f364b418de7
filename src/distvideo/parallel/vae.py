"""Exact parallel VAE decode: each rank decodes one band of rows. The machinery (bands, halo exchange, the gather
around global attention, the final gather) is here; which of a VAE's modules get halos is the family's declaration
(`VaeBands`: families/wan/vae.py for AutoencoderKLWan, families/hunyuan15/vae.py for AutoencoderKLHunyuanVideo15).

Wan's decoder is local in rows almost everywhere: 3x3 spatial convolutions (causal in time, with a per-frame
feature cache), per-pixel RMS norms over channels, SiLU, nearest upsampling (output row i comes from input row i//2)
and 3x1x1 time convolutions. So a rank can decode its band of latent rows exactly if, before every convolution with
a spatial kernel, it receives the `padding` rows next to its band from each neighbour (zeros only at the true top
and bottom edges). The causal time cache then holds un-haloed frames and the halo is taken over cache + new frames
together, so cached rows always match what the single-rank decoder saw. The mid block's attention is global over
the frame: the bands are gathered before it (it runs at latent resolution, which is cheap) and split after. A fixed
margin instead of per-layer halos would not pay: the receptive field of the upsampling path is about a dozen latent
rows. Finally the output rank gathers the bands.

The plan patches the decoder's modules in place (instance `forward` of the spatial convolutions, hooks on the
attention blocks) and is inert outside :meth:`BandedVaeDecoder.decode`, so single-rank decoding is unchanged.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distvideo.parallel.collectives import collective

logger = logging.getLogger(__name__)

#: Fewest latent rows a band may have. Halo traffic per convolution is fixed (one row per side) while the work
#: shrinks with the band, and below two rows every first-level convolution exchanges as many rows as it computes.
MIN_BAND_ROWS = 2

#: How a family's VAE is banded (its package declares it, the worker hands it to the plans): patch `vae`'s decoder
#: in place through the decoder's `patch` and `gather_around_attention`, or raise NotImplementedError for a module
#: not known to be local in rows. A VAE without one is decoded whole on the replica's first rank.
VaeBands = Callable[["BandedVaeDecoder", Any], None]


# --- band arithmetic (pure) -----------------------------------------------------------------------------------------


def split_rows(num_rows: int, num_bands: int) -> list[tuple[int, int]]:
    """Contiguous (start, stop) bands covering `num_rows`; the first `num_rows % num_bands` get one row more."""
    if num_bands < 1 or num_rows < num_bands:
        raise ValueError(f"cannot split {num_rows} rows into {num_bands} non-empty bands")
    base, extra = divmod(num_rows, num_bands)
    bands, start = [], 0
    for i in range(num_bands):
        stop = start + base + (1 if i < extra else 0)
        bands.append((start, stop))
        start = stop
    return bands


def decode_band_count(latent_rows: int, world_size: int, min_rows: int = MIN_BAND_ROWS) -> int:
    """How many ranks decode: all of them, unless bands would get fewer than `min_rows` latent rows (then fewer
    ranks, the first ones; 1 means a single-rank decode on the output rank)."""
    if latent_rows < 1 or world_size < 1 or min_rows < 1:
        raise ValueError(f"bad decode split: latent_rows={latent_rows}, world_size={world_size}, min_rows={min_rows}")
    return max(1, min(world_size, latent_rows // min_rows))


def conv_row_halo(kernel_rows: int, stride_rows: int, padding_rows: int) -> int:
    """Rows a band needs from each neighbour before a 'same' convolution: its padding (kernel 3 -> 1)."""
    if stride_rows != 1 or kernel_rows != 2 * padding_rows + 1:
        raise ValueError(
            f"a banded decode needs stride-1 'same' convolutions over rows; got kernel {kernel_rows}, stride "
            f"{stride_rows}, padding {padding_rows}"
        )
    return padding_rows


# --- the band of one decode -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Band:
    group: Any
    index: int  # position in the group (band order = rank order)
    bands: tuple[tuple[int, int], ...]  # latent rows of every band
    prev_rank: int | None  # global rank holding the band above, None at the top edge
    next_rank: int | None

    @property
    def count(self) -> int:
        return len(self.bands)

    def rows(self, i: int) -> int:
        return self.bands[i][1] - self.bands[i][0]


class BandedVaeDecoder:
    """Decode with the world split into bands of rows; apply once to the loaded VAE (a ModulePlan), then call
    `decode`."""

    component = "vae"
    name = "vae-band-decode"
    row_halo = staticmethod(conv_row_halo)  # for the families' VaeBands declarations

    def __init__(self, group_for: Callable[[int], Any], rank: int, world_size: int, min_rows: int = MIN_BAND_ROWS):
        self.group_for = group_for  # size -> group of the replica's ranks 0..size-1, None outside (prefix_group)
        self.rank = rank
        self.world_size = world_size
        self.min_rows = min_rows
        self.counts: Counter[str] = Counter()
        self.vae: Any = None
        self._band: _Band | None = None
        self._restore: list[Callable[[], None]] = []
        self.bands: VaeBands | None = None  # the family's declaration, set by ParallelContext.plans,
        self.banded_vae: str | None = None  # with the VAE class the bands are proven exact for
        self.banded = True  # False: a VAE without a declaration, decoded whole on rank 0

    # -- applying ------------------------------------------------------------------------------------------
    def apply(self, vae: Any) -> Callable[[], None]:
        if self.bands is None or type(vae).__name__ != self.banded_vae:  # none for this VAE: whole, on the first rank
            logger.debug("%s: no exact banded decode declared; decoding on one rank", type(vae).__name__)
            self.vae, self.banded = vae, False
            return self.remove
        self.bands(self, vae)
        self.vae = vae
        return self.remove

    def remove(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore = []

    def patch(self, module: nn.Module, forward: Callable[..., torch.Tensor]) -> None:
        """Replace `module`'s forward (an instance attribute) until the plan is removed."""
        module.forward = forward
        self._restore.append(lambda: delattr(module, "forward"))

    def gather_around_attention(self, module: nn.Module) -> None:
        """A global attention block of the decoder: the bands gathered before it and split after it, inside a decode."""
        handles = [
            module.register_forward_pre_hook(self._gather_before_attention),
            module.register_forward_hook(self._split_after_attention),
        ]
        self._restore += [h.remove for h in handles]

    @property
    def band(self) -> _Band | None:
        """The band of the decode in progress (None outside one: the patched modules run as on one rank)."""
        return self._band

    # -- communication inside a decode ---------------------------------------------------------------------
    def haloed(self, parts: list[torch.Tensor], halo: int, *, front: int = 0, w_pad: int = 0) -> torch.Tensor:
        """The input of a convolution over this rank's band, built in one buffer: `parts` (..., rows, W) joined
        along time (dim 2 of 5-D tensors), `front` zero frames before them, `halo` rows of each neighbour's band
        above and below (zeros at the true top and bottom edges), and `w_pad` zero columns on each side."""
        band = self._band
        assert band is not None
        first = parts[0]
        rows, width = first.shape[-2:]
        if rows < halo:
            raise RuntimeError(f"a band of {rows} rows cannot provide a halo of {halo}")
        if first.ndim == 5:
            frames = sum(p.shape[2] for p in parts)
            buffer = first.new_empty((*first.shape[:2], front + frames, rows + 2 * halo, width + 2 * w_pad))
            if front:
                buffer[:, :, :front].zero_()
            body = buffer[:, :, front:]
        else:
            if len(parts) > 1 or front:
                raise ValueError("only 5-D inputs (with a time dimension) can be joined or padded in time")
            buffer = body = first.new_empty((*first.shape[:-2], rows + 2 * halo, width + 2 * w_pad))
        if w_pad:
            buffer[..., :w_pad].zero_()
            buffer[..., -w_pad:].zero_()
        inner = body[..., w_pad : w_pad + width]  # the real columns: halo rows + band rows + halo rows

        def edge_rows(rows_slice: slice) -> torch.Tensor:  # this band's rows `rows_slice` of every part, joined
            pieces = [part[..., rows_slice, :] for part in parts]
            return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=2)

        # post the exchange first, straight from the inputs, so the messages travel while the buffer is filled
        ops, received = [], []
        for neighbour, mine, theirs in (
            (band.prev_rank, slice(0, halo), slice(0, halo)),
            (band.next_rank, slice(rows - halo, rows), slice(rows + halo, rows + 2 * halo)),
        ):
            if neighbour is None:
                body[..., theirs, :].zero_()  # the true frame edge: zero padding, as on one rank
                continue
            incoming = torch.empty_like(inner[..., theirs, :])
            ops += [
                dist.P2POp(dist.isend, edge_rows(mine), neighbour, band.group),
                dist.P2POp(dist.irecv, incoming, neighbour, band.group),
            ]
            received.append((theirs, incoming))
        with collective("the decode's halo exchange"):
            works = dist.batch_isend_irecv(ops) if ops else []
        start = 0
        for part in parts:
            target = inner[:, :, start : start + part.shape[2]] if first.ndim == 5 else inner
            target[..., halo : halo + rows, :].copy_(part)
            start += part.shape[2] if first.ndim == 5 else 0
        with collective("the decode's halo exchange"):
            for work in works:
                work.wait()
        for rows_slice, incoming in received:
            inner[..., rows_slice, :].copy_(incoming)
        self.counts["halo_exchange"] += 1
        return buffer

    def gather_rows(self, x: torch.Tensor, dst: int | None = None) -> torch.Tensor | None:
        """The full frame from every rank's band (rows are dim -2): on every rank, or only on group rank `dst`."""
        band = self._band
        assert band is not None
        scale = x.shape[-2] // band.rows(band.index)  # bands grow alike through the decoder's upsampling
        most = max(band.rows(i) for i in range(band.count)) * scale
        padded = (
            x
            if x.shape[-2] == most
            else torch.cat([x, x.new_zeros((*x.shape[:-2], most - x.shape[-2], x.shape[-1]))], -2)
        )
        padded = padded.contiguous()
        pieces = [torch.empty_like(padded) for _ in range(band.count)]
        if dst is None:
            with collective("the decode's row gather"):
                dist.all_gather(pieces, padded, group=band.group)
            self.counts["all_gather"] += 1
        else:
            receiving = band.index == dst
            with collective("the decode's row gather"):
                dist.gather(padded, pieces if receiving else None, group_dst=dst, group=band.group)
            self.counts["gather"] += 1
            if not receiving:
                return None
        return torch.cat([p[..., : band.rows(i) * scale, :] for i, p in enumerate(pieces)], dim=-2)

    def _gather_before_attention(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._band is None:
            return None
        return (self.gather_rows(args[0]), *args[1:])

    def _split_after_attention(self, module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        band = self._band
        if band is None:
            return None
        scale = output.shape[-2] // sum(band.rows(i) for i in range(band.count))
        start, stop = band.bands[band.index]
        return output[..., start * scale : stop * scale, :].contiguous()

    # -- decoding ------------------------------------------------------------------------------------------
    @contextmanager
    def _active(self, band: _Band) -> Iterator[None]:
        self._band = band
        try:
            yield
        finally:
            self._band = None

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """Decoded video (B, C, T, H, W) on rank 0, None on the other ranks. Every rank must call it."""
        if self.vae is None:
            raise RuntimeError("BandedVaeDecoder.decode before apply(vae)")
        latent_rows = latents.shape[-2]
        count = decode_band_count(latent_rows, self.world_size, self.min_rows)
        if getattr(self.vae, "use_tiling", False) or not self.banded:
            count = 1  # diffusers' tiled decode blends overlapping tiles: not a banded computation
        if count == 1:
            logger.debug("latent height %d: decoding on rank 0 only", latent_rows)
            return self.vae.decode(latents, return_dict=False)[0] if self.rank == 0 else None
        group = self.group_for(count)
        if self.rank >= count:
            return None
        bands = tuple(split_rows(latent_rows, count))
        band = _Band(
            group=group,
            index=self.rank,
            bands=bands,
            prev_rank=dist.get_global_rank(group, self.rank - 1) if self.rank > 0 else None,
            next_rank=dist.get_global_rank(group, self.rank + 1) if self.rank < count - 1 else None,
        )
        start, stop = bands[self.rank]
        with self._active(band):
            video = self.vae.decode(latents[..., start:stop, :].contiguous(), return_dict=False)[0]
            return self.gather_rows(video, dst=0)

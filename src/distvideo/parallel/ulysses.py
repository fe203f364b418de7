"""Ulysses sequence parallelism, applied as a plan to a loaded diffusers transformer at the hook points its family
declares (`SequencePoints`: families/wan/ for WanTransformer3DModel's ``blocks`` and ``attn1`` with
`UlyssesAttnProcessor`; families/hunyuan15/ for HunyuanVideo15Transformer3DModel's ``transformer_blocks`` and ``attn``
with its joint-attention processor). What follows describes Wan's hook points.

The model file stays untouched (as torchtitan keeps `parallelize.py` apart from `model.py`); hooks and one attention
processor change what flows through it:

- model pre-hook: derive the token count of this forward from the latent shape and the patch size;
- ``rope`` hook: keep this rank's slice of the rotary tables;
- ``blocks.0`` pre-hook: pad the token sequence to a multiple of sp and keep this rank's contiguous shard;
- with a timestep per token (Wan2.2 TI2V-5B's ``expand_timesteps``): a pre-hook on every block keeps this rank's
  shard of the per-token modulation (``temb``, computed once per forward), and the shards are gathered before
  ``norm_out`` instead of after ``proj_out``, since the output modulation is per token too;
- ``attn1`` of every block: Wan's ``UlyssesAttnProcessor`` (families/wan/attention.py) projects q, k, v for the local tokens and all heads, moves
  them with ONE all-to-all to all tokens and heads/sp (heads scattered, sequence gathered), attends, and moves the
  output back with one more; padded key positions are cut off before attention, so they never take part;
- under USP (``sp = ulysses x ring``, parallel/ring.py) the all-to-alls run over the Ulysses group only (none when
  its degree is 1), which leaves each rank one contiguous chunk of the sequence, and the attention is ring
  attention over the ring group instead of one local call; the plan is then named ``usp``;
- ``attn2`` (cross-attention) is unchanged: local tokens against the full text, no communication;
- ``proj_out`` hook: all-gather the shards and drop the padding, before the model unpatchifies.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distvideo.models import compat
from distvideo.parallel.collectives import collective
from distvideo.parallel.ring import RingAttention

logger = logging.getLogger(__name__)


# --- sequence arithmetic (pure) -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceShard:
    """Rank `sp_rank`'s contiguous share of a sequence of `seq_len` tokens padded to a multiple of `sp_size`."""

    seq_len: int
    sp_size: int
    sp_rank: int

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.sp_size < 1 or not 0 <= self.sp_rank < self.sp_size:
            raise ValueError(f"bad shard: seq_len={self.seq_len}, sp_size={self.sp_size}, sp_rank={self.sp_rank}")

    @property
    def padded_len(self) -> int:
        return -(-self.seq_len // self.sp_size) * self.sp_size

    @property
    def pad(self) -> int:
        return self.padded_len - self.seq_len

    @property
    def local_len(self) -> int:
        return self.padded_len // self.sp_size

    @property
    def start(self) -> int:
        return self.sp_rank * self.local_len

    @property
    def stop(self) -> int:
        return self.start + self.local_len

    @property
    def real_local_len(self) -> int:
        """How many of this rank's tokens are real (the padding sits at the end of the last shards)."""
        return max(0, min(self.stop, self.seq_len) - self.start)


def pad_dim(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`x` padded with zeros at the end of `dim` to `length` (unchanged when already that long)."""
    extra = length - x.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad dim {dim} of size {x.shape[dim]} to the shorter length {length}")
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def take_shard(x: torch.Tensor, dim: int, shard: SequenceShard) -> torch.Tensor:
    return pad_dim(x, dim, shard.padded_len).narrow(dim, shard.start, shard.local_len).contiguous()


# --- where a family takes the plan ---------------------------------------------------------------------------------


class SequenceAttnProcessor:
    """The base of a family's attention processor under the plan (SequencePoints.processor): what diffusers' attention
    modules ask of a processor, the plan (its all-to-alls, ring, shard) and the attention backend the engine set."""

    def __init__(self, plan: UlyssesPlan, attention_backend: Any = None):
        for name, value in compat.PROCESSOR_PROTOCOL_ATTRIBUTES.items():
            setattr(self, name, value)
        self.plan = plan
        self._attention_backend = attention_backend


@dataclass(frozen=True)
class SequencePoints:
    """Where a transformer class takes the plan: its list of blocks, each block's self-attention and the processor
    that replaces it, the sequence dimension of its rotary tables, whether ring attention serves it."""

    blocks: str
    attention: str
    processor: Callable[[UlyssesPlan, Any], Any]
    rope_seq_dim: int
    ring: bool

    @staticmethod
    def patch_size(config: Any) -> tuple[int, int, int]:
        patch = config.patch_size
        if isinstance(patch, int):  # HunyuanVideo: patch_size and patch_size_t
            return int(config.patch_size_t), patch, patch
        p_t, p_h, p_w = (int(p) for p in patch)
        return p_t, p_h, p_w


# --- the plan -------------------------------------------------------------------------------------------------------


class UlyssesPlan:
    """Applies Ulysses sequence parallelism to a WanTransformer3DModel in place (a ModulePlan); `remove()`, the undo
    `apply` returns, undoes it.

    `group` is the ``sp`` dimension of the layout's mesh (ParallelGroups.sp). `counts` records the collectives issued
    ("all_to_all", "all_gather"), so tests can check there are exactly two all-to-alls per self-attention layer.
    Under USP `ulysses_group` (of `ulysses_size` ranks) carries the all-to-alls and `ring` the attention across the
    ring group; without them Ulysses spans the whole ``sp`` group.
    """

    component = "transformer"

    def __init__(
        self,
        group: Any,
        sp_size: int,
        sp_rank: int,
        *,
        component: str = "transformer",
        counts: Counter[str] | None = None,
        ulysses_group: Any = None,
        ulysses_size: int | None = None,
        ring: RingAttention | None = None,
    ):
        if sp_size < 2:
            raise ValueError(f"Ulysses needs sp_size >= 2, got {sp_size}")
        self.component = component
        self.points: SequencePoints | None = None  # the family's declaration, set by ParallelContext.plans
        self.group = group
        self.sp_size = sp_size
        self.sp_rank = sp_rank
        self.ring = ring
        self.ulysses_size = sp_size if ulysses_size is None else ulysses_size
        self.ulysses_group = group if ulysses_group is None and ring is None else ulysses_group
        ring_size = ring.ring_size if ring is not None else 1
        if self.ulysses_size * ring_size != sp_size:
            raise ValueError(f"ulysses_size({self.ulysses_size}) * ring_size({ring_size}) != sp_size({sp_size})")
        self.name = "usp" if ring is not None else "ulysses"
        self.counts: Counter[str] = counts if counts is not None else Counter()
        self._shard: SequenceShard | None = None
        self._per_token = False  # this forward has a timestep per token
        self._temb: tuple[torch.Tensor, torch.Tensor] | None = None  # (full per-token modulation, this rank's shard)
        self._handles: list[Any] = []
        self._processors: list[tuple[Any, Any]] = []
        self._patch_size: tuple[int, ...] = (1, 2, 2)
        self._rope_dim = 1  # the sequence dimension of the rotary tables

    @property
    def ulysses_rank(self) -> int:
        """This rank's place in the Ulysses group: the all-to-all gives it the heads ulysses_rank * H/ulysses on."""
        if self.ring is None:
            return self.sp_rank
        return dist.get_rank(self.ulysses_group) if self.ulysses_size > 1 else 0

    @property
    def shard(self) -> SequenceShard:
        if self._shard is None:
            raise RuntimeError("the Ulysses plan saw no transformer forward yet")
        return self._shard

    # -- applying ------------------------------------------------------------------------------------------
    def apply(self, transformer: Any) -> Callable[[], None]:
        points = self.points
        if points is None:
            raise NotImplementedError(
                f"sequence parallelism has no hook points for {type(transformer).__name__} (its family declares no "
                "SequencePoints): run it with sp_size=1"
            )
        if self.ring is not None and not points.ring:
            raise ValueError(
                f"ring attention is not declared for {type(transformer).__name__} (its SequencePoints); use Ulysses "
                "alone (ring_size=1)"
            )
        heads = int(transformer.config.num_attention_heads)
        if heads % self.ulysses_size:
            raise ValueError(f"ulysses_size({self.ulysses_size}) must divide the attention heads({heads})")
        self._patch_size = points.patch_size(transformer.config)
        self._rope_dim = points.rope_seq_dim
        blocks = getattr(transformer, points.blocks)
        self._handles += [
            transformer.register_forward_pre_hook(self._on_model_input, with_kwargs=True),
            transformer.rope.register_forward_hook(self._on_rope_output),
            blocks[0].register_forward_pre_hook(self._on_first_block_input, with_kwargs=True),
            transformer.norm_out.register_forward_pre_hook(self._on_norm_out_input),
            transformer.proj_out.register_forward_hook(self._on_proj_out_output),
        ]
        self._handles += [block.register_forward_pre_hook(self._on_block_input) for block in blocks]
        for block in blocks:
            attn = getattr(block, points.attention)
            original = attn.processor
            self._processors.append((attn, original))
            attn.set_processor(points.processor(self, compat.attention_backend(original)))
        return self.remove

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for attn, original in self._processors:
            attn.set_processor(original)
        self._handles, self._processors = [], []

    # -- hooks ---------------------------------------------------------------------------------------------
    def _on_model_input(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        timestep = kwargs["timestep"] if "timestep" in kwargs else args[1]
        self._per_token = timestep.ndim == 2
        self._temb = None
        f, h, w = hidden_states.shape[2:]
        p_t, p_h, p_w = self._patch_size
        self._shard = SequenceShard((f // p_t) * (h // p_h) * (w // p_w), self.sp_size, self.sp_rank)

    def _on_rope_output(self, module: Any, args: Any, output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # Wan's (1, S, 1, D) -> (1, S/sp, 1, D); HunyuanVideo 1.5's (S, D) -> (S/sp, D)
        return tuple(take_shard(freqs, self._rope_dim, self.shard) for freqs in output)

    def _on_first_block_input(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": take_shard(kwargs["hidden_states"], 1, self.shard)}
        else:
            args = (take_shard(args[0], 1, self.shard), *args[1:])
        return args, kwargs

    def _on_block_input(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Per-token modulation (B, S, 6, D) -> this rank's (B, S/sp, 6, D), once per forward for all blocks."""
        if not self._per_token or len(args) < 3:
            return None
        temb = args[2]
        if self._temb is None or self._temb[0] is not temb:
            self._temb = (temb, take_shard(temb, 1, self.shard))
        return (*args[:2], self._temb[1], *args[3:])

    def _on_norm_out_input(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self._per_token:
            return None
        self._temb = None
        return (self.gather_sequence(args[0]), *args[1:])

    def _on_proj_out_output(self, module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self._per_token:
            return None  # gathered before norm_out
        return self.gather_sequence(output)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's shard (B, S/sp, ...) -> the whole sequence without its padding (B, S, ...)."""
        shards = [torch.empty_like(x) for _ in range(self.sp_size)]
        with collective("the Ulysses output gather"):
            dist.all_gather(shards, x.contiguous(), group=self.group)
        self.counts["all_gather"] += 1
        return torch.cat(shards, dim=1)[:, : self.shard.seq_len]

    # -- the two all-to-alls -------------------------------------------------------------------------------
    def scatter_heads_gather_sequence(self, qkv: torch.Tensor) -> torch.Tensor:
        """(3, B, S/sp, H, D) on each rank -> (3, B, S_padded, H/sp, D): rank j receives heads j*H/sp.. of all. Under
        USP sp here is the Ulysses degree and S_padded the ring chunk's length."""
        n, b, s_local, heads, d = qkv.shape
        sp = self.ulysses_size
        send = qkv.reshape(n, b, s_local, sp, heads // sp, d).permute(3, 0, 1, 2, 4, 5).contiguous()
        recv = torch.empty_like(send)  # (sp source ranks, 3, B, S/sp, H/sp, D)
        with collective("a Ulysses all-to-all"):
            dist.all_to_all_single(recv, send, group=self.ulysses_group)
        self.counts["all_to_all"] += 1
        return recv.permute(1, 2, 0, 3, 4, 5).reshape(n, b, sp * s_local, heads // sp, d)

    def scatter_sequence_gather_heads(self, out: torch.Tensor) -> torch.Tensor:
        """(B, S_padded, H/sp, D) -> (B, S/sp, H, D): the inverse of `scatter_heads_gather_sequence` for one tensor."""
        b, s_padded, heads_local, d = out.shape
        sp = self.ulysses_size
        send = out.reshape(b, sp, s_padded // sp, heads_local, d).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)  # (sp source ranks = head chunks, B, S/sp, H/sp, D)
        with collective("a Ulysses all-to-all"):
            dist.all_to_all_single(recv, send, group=self.ulysses_group)
        self.counts["all_to_all"] += 1
        return recv.permute(1, 2, 0, 3, 4).reshape(b, s_padded // sp, sp * heads_local, d)

"""The parallel layout: how the world of ranks splits into CFG halves and sequence-parallel groups.

One small dataclass knows every degree and checks them once, with errors that show the arithmetic. Rank order:
``rank = cfg_rank * sp_size + sp_rank``, so the ranks of one sequence-parallel group are contiguous (on GPUs they
share a node and its fast links, which the per-layer all-to-alls need most), and the two ranks of a CFG pair are
``sp_size`` apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from distvideo.config import ConfigError

CFG_DEGREE = 2  # classifier-free guidance has two branches: conditional and unconditional


@dataclass(frozen=True)
class ParallelLayout:
    """world_size = cfg_degree x sp_size; `num_heads` (when known) must divide by sp_size (Ulysses splits heads)."""

    world_size: int
    sp_size: int = 1
    cfg_degree: int = 1
    num_heads: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.sp_size < 1:
            raise ConfigError(f"world_size({self.world_size}) and sp_size({self.sp_size}) must be >= 1")
        if self.cfg_degree not in (1, CFG_DEGREE):
            raise ConfigError(f"cfg_degree({self.cfg_degree}) must be 1 (off) or {CFG_DEGREE} (cfg_parallel)")
        if self.cfg_degree * self.sp_size != self.world_size:
            raise ConfigError(
                f"cfg({self.cfg_degree}) * sp({self.sp_size}) = {self.cfg_degree * self.sp_size} != "
                f"world_size({self.world_size}); {_what_works(self.world_size, self.num_heads)}"
            )
        if self.num_heads is not None and self.num_heads % self.sp_size:
            raise ConfigError(
                f"sp_size({self.sp_size}) must divide the model's attention heads({self.num_heads}): Ulysses gives "
                f"each rank heads/sp of them; {_what_works(self.world_size, self.num_heads)}"
            )

    # -- questions ---------------------------------------------------------------------------------
    @property
    def cfg_enabled(self) -> bool:
        return self.cfg_degree > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    def cfg_rank(self, rank: int) -> int:
        """0: the conditional branch, 1: the unconditional branch."""
        return rank // self.sp_size

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp_size

    def sp_group_ranks(self) -> list[list[int]]:
        """Every sequence-parallel group (contiguous ranks), in cfg_rank order."""
        return [[c * self.sp_size + s for s in range(self.sp_size)] for c in range(self.cfg_degree)]

    def cfg_group_ranks(self) -> list[list[int]]:
        """Every CFG pair (ranks sp_size apart), in sp_rank order."""
        return [[c * self.sp_size + s for c in range(self.cfg_degree)] for s in range(self.sp_size)]

    def describe(self) -> str:
        return f"world {self.world_size} = cfg {self.cfg_degree} x sp {self.sp_size}"


def resolve_layout(
    world_size: int, *, sp_size: int | None = None, cfg_parallel: bool | None = None, num_heads: int | None = None
) -> ParallelLayout:
    """The layout for `world_size` ranks given the user's (possibly unset) sp_size and cfg_parallel.

    Defaults: with an even world size CFG parallelism is on and sp = world / 2; with an odd one sp = world.
    Raises ConfigError naming the conflicting numbers and the layouts that would work.
    """
    if world_size < 1:
        raise ConfigError(f"world_size({world_size}) must be >= 1")
    if sp_size is not None and sp_size < 1:
        raise ConfigError(f"sp_size({sp_size}) must be >= 1")
    if cfg_parallel is True and world_size % CFG_DEGREE:
        raise ConfigError(
            f"cfg_parallel=True needs an even world size (the two CFG branches run on two halves), got "
            f"world_size({world_size}); {_what_works(world_size, num_heads)}"
        )
    if cfg_parallel is None:
        if sp_size is None:
            cfg_degree = CFG_DEGREE if world_size % CFG_DEGREE == 0 else 1
        elif sp_size * CFG_DEGREE == world_size:
            cfg_degree = CFG_DEGREE
        else:
            cfg_degree = 1
    else:
        cfg_degree = CFG_DEGREE if cfg_parallel else 1
    if sp_size is None:
        sp_size = world_size // cfg_degree
    return ParallelLayout(world_size=world_size, sp_size=sp_size, cfg_degree=cfg_degree, num_heads=num_heads)


def valid_layouts(world_size: int, num_heads: int | None = None) -> list[tuple[int, int]]:
    """Every (cfg_degree, sp_size) that fits `world_size` ranks and `num_heads` heads."""
    out = []
    for cfg in (CFG_DEGREE, 1):
        if world_size % cfg:
            continue
        sp = world_size // cfg
        if num_heads is None or num_heads % sp == 0:
            out.append((cfg, sp))
    return out


def _what_works(world_size: int, num_heads: int | None) -> str:
    options = valid_layouts(world_size, num_heads)
    heads = f" and {num_heads} heads" if num_heads is not None else ""
    if options:
        shown = " or ".join(f"sp_size={sp}, cfg_parallel={cfg > 1}" for cfg, sp in options)
        return f"with {world_size} rank(s){heads} use {shown}"
    sizes = [n for n in range(1, 2 * (num_heads or 1) + 1) if valid_layouts(n, num_heads)] if num_heads else []
    return f"no layout fits {world_size} rank(s){heads}; launch a world size among {sizes[:8]}"

"""The parallel layout: how the world of ranks splits into data-parallel replicas, CFG halves and sequence-parallel
groups, and a sequence-parallel group into Ulysses and ring sub-groups (``sp = ulysses x ring``, USP).

One small dataclass knows every degree and checks them once, with errors that show the arithmetic. Rank order:
``rank = replica * (cfg_degree * sp_size) + cfg_rank * sp_size + sp_rank``, so a replica's ranks are contiguous (one
node, where it fits), the ranks of one sequence-parallel group are contiguous within it (on GPUs they share a node and
its fast links, which the per-layer all-to-alls need most), and the two ranks of a CFG pair are ``sp_size`` apart. A
replica runs one request at a time with the cfg x sp layout; replicas run different requests (batch jobs) and never
talk to each other until the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distvideo.errors import ConfigError

CFG_DEGREE = 2  # classifier-free guidance has two branches: conditional and unconditional


@dataclass(frozen=True)
class ParallelLayout:
    """world_size = replicas x cfg_degree x sp_size, sp_size = ulysses_size x ring_size; `num_heads` (when known)
    must divide by ulysses_size (Ulysses splits heads; ring attention splits the sequence only)."""

    world_size: int
    sp_size: int = 1
    cfg_degree: int = 1
    num_heads: int | None = None
    replicas: int = 1
    ring_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.sp_size < 1 or self.replicas < 1:
            raise ConfigError(
                f"world_size({self.world_size}), sp_size({self.sp_size}) and replicas({self.replicas}) must be >= 1"
            )
        if self.cfg_degree not in (1, CFG_DEGREE):
            raise ConfigError(f"cfg_degree({self.cfg_degree}) must be 1 (off) or {CFG_DEGREE} (cfg_parallel)")
        if self.replicas * self.cfg_degree * self.sp_size != self.world_size:
            product = self.replicas * self.cfg_degree * self.sp_size
            raise ConfigError(
                f"replicas({self.replicas}) * cfg({self.cfg_degree}) * sp({self.sp_size}) = {product} != "
                f"world_size({self.world_size}); {_what_works(self.world_size // self.replicas or 1, self.num_heads)}"
                + (f" per replica ({self.replicas} replicas)" if self.replicas > 1 else "")
            )
        if self.ring_size < 1 or self.sp_size % self.ring_size:
            raise ConfigError(
                f"ring_size({self.ring_size}) must be >= 1 and divide sp_size({self.sp_size}): sp_size = "
                f"ulysses_size x ring_size; with sp_size {self.sp_size} use ring_size among {_divisors(self.sp_size)}"
            )
        if self.num_heads is not None and self.num_heads % self.ulysses_size:
            raise ConfigError(
                f"ulysses_size({self.ulysses_size}) must divide the model's attention heads({self.num_heads}): Ulysses "
                f"gives each rank heads/ulysses of them; with sp_size {self.sp_size} use ulysses_size "
                f"{default_ulysses_size(self.sp_size, self.num_heads)} (ring attention takes the rest of sp)"
            )

    # -- questions ---------------------------------------------------------------------------------
    @property
    def cfg_enabled(self) -> bool:
        return self.cfg_degree > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    # -- the sequence-parallel group: ulysses x ring ----------------------------------------------------------------
    @property
    def ulysses_size(self) -> int:
        return self.sp_size // self.ring_size

    @property
    def ring_enabled(self) -> bool:
        return self.ring_size > 1

    def ulysses_rank(self, rank: int) -> int:
        return self.sp_rank(rank) % self.ulysses_size

    def ring_rank(self, rank: int) -> int:
        return self.sp_rank(rank) // self.ulysses_size

    @property
    def replica_size(self) -> int:
        """Ranks of one replica: cfg_degree x sp_size."""
        return self.cfg_degree * self.sp_size

    def replica(self, rank: int) -> int:
        return rank // self.replica_size

    def replica_rank(self, rank: int) -> int:
        """The rank's place inside its replica; 0 is the replica's output rank."""
        return rank % self.replica_size

    def output_ranks(self) -> list[int]:
        """The output rank of every replica (its first rank): frames and videos are written there."""
        return [k * self.replica_size for k in range(self.replicas)]

    def cfg_rank(self, rank: int) -> int:
        """0: the conditional branch, 1: the unconditional branch."""
        return self.replica_rank(rank) // self.sp_size

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp_size

    def replica_group_ranks(self) -> list[list[int]]:
        """Every replica's ranks (contiguous), in replica order."""
        return [list(range(k * self.replica_size, (k + 1) * self.replica_size)) for k in range(self.replicas)]

    def sp_group_ranks(self) -> list[list[int]]:
        """Every sequence-parallel group (contiguous ranks), by replica, then cfg_rank."""
        return [
            [base + c * self.sp_size + s for s in range(self.sp_size)]
            for base in self.output_ranks()
            for c in range(self.cfg_degree)
        ]

    def cfg_group_ranks(self) -> list[list[int]]:
        """Every CFG pair (ranks sp_size apart), by replica, then sp_rank."""
        return [
            [base + c * self.sp_size + s for c in range(self.cfg_degree)]
            for base in self.output_ranks()
            for s in range(self.sp_size)
        ]

    def describe(self) -> str:
        replicas = f"replicas {self.replicas} x " if self.replicas > 1 else ""
        usp = f" (ulysses {self.ulysses_size} x ring {self.ring_size})" if self.ring_enabled else ""
        return f"world {self.world_size} = {replicas}cfg {self.cfg_degree} x sp {self.sp_size}{usp}"


def default_ulysses_size(sp_size: int, num_heads: int | None) -> int:
    """The Ulysses share of `sp_size` when only sp is given: the largest divisor of the heads that divides sp (all
    of sp when the heads are unknown); ring attention takes the rest."""
    if num_heads is None:
        return sp_size
    return max(d for d in _divisors(sp_size) if num_heads % d == 0)


def split_sequence_parallel(
    sp_size: int, num_heads: int | None, ulysses_size: int | None = None, ring_size: int | None = None
) -> int:
    """The ring_size of `sp_size` given the user's (possibly unset) ulysses_size and ring_size; ConfigError naming
    the option when they do not multiply to sp_size. The heads are checked by ParallelLayout."""
    if ulysses_size is not None and ring_size is not None and ulysses_size * ring_size != sp_size:
        raise ConfigError(
            f"ulysses_size({ulysses_size}) * ring_size({ring_size}) = {ulysses_size * ring_size} != "
            f"sp_size({sp_size}); sp_size = ulysses_size x ring_size"
        )
    for name, given in (("ulysses_size", ulysses_size), ("ring_size", ring_size)):
        if given is not None and sp_size % given:
            raise ConfigError(
                f"{name}({given}) must divide sp_size({sp_size}) (sp_size = ulysses_size x ring_size); use one "
                f"among {_divisors(sp_size)}"
            )
    if ring_size is not None:
        return ring_size
    if ulysses_size is not None:
        return sp_size // ulysses_size
    return sp_size // default_ulysses_size(sp_size, num_heads)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_layout(
    world_size: int,
    *,
    sp_size: int | None = None,
    cfg_parallel: bool | None = None,
    num_heads: int | None = None,
    replicas: int | None = None,
    ulysses_size: int | None = None,
    ring_size: int | None = None,
) -> ParallelLayout:
    """The layout for `world_size` ranks given the user's (possibly unset) replicas, sp_size, cfg_parallel,
    ulysses_size and ring_size (sp_size = ulysses_size x ring_size; both given fix sp_size; with neither, Ulysses
    takes the largest divisor of the heads that divides sp, ring the rest).

    Replicas: 1 unless given, or derived when both sp_size and cfg_parallel are given (world / (cfg x sp)). Within a
    replica: with an even replica size CFG parallelism is on and sp = size / 2; with an odd one sp = size.
    Raises ConfigError naming the conflicting numbers and the layouts that would work.
    """
    if world_size < 1:
        raise ConfigError(f"world_size({world_size}) must be >= 1")
    for name, given in (("ulysses_size", ulysses_size), ("ring_size", ring_size)):
        if given is not None and given < 1:
            raise ConfigError(f"{name}({given}) must be >= 1 (sp_size = ulysses_size x ring_size)")
    if sp_size is None and ulysses_size is not None and ring_size is not None:
        sp_size = ulysses_size * ring_size
    if replicas is None and sp_size is not None and cfg_parallel is not None and sp_size >= 1:
        fixed = sp_size * (CFG_DEGREE if cfg_parallel else 1)
        replicas = world_size // fixed if world_size % fixed == 0 else 1
    replicas = 1 if replicas is None else replicas
    if replicas < 1 or world_size % replicas:
        raise ConfigError(
            f"replicas({replicas}) must divide world_size({world_size}): each replica gets world / replicas ranks; "
            f"with {world_size} rank(s) use replicas among {[n for n in range(1, world_size + 1) if world_size % n == 0]}"
        )
    multiple = math.lcm(ulysses_size or 1, ring_size or 1)  # an sp left to the default must hold what was given
    layout = _resolve_replica(world_size // replicas, sp_size, cfg_parallel, num_heads, multiple)
    return ParallelLayout(
        world_size=world_size,
        sp_size=layout.sp_size,
        cfg_degree=layout.cfg_degree,
        num_heads=num_heads,
        replicas=replicas,
        ring_size=split_sequence_parallel(layout.sp_size, num_heads, ulysses_size, ring_size),
    )


def _resolve_replica(
    world_size: int, sp_size: int | None, cfg_parallel: bool | None, num_heads: int | None, sp_multiple: int = 1
) -> ParallelLayout:
    """The cfg x sp layout of one replica of `world_size` ranks; automatic CFG parallelism stays off when it would
    leave a default sp that is no multiple of `sp_multiple` (a given ulysses_size or ring_size)."""
    if sp_size is not None and sp_size < 1:
        raise ConfigError(f"sp_size({sp_size}) must be >= 1")
    if cfg_parallel is True and world_size % CFG_DEGREE:
        raise ConfigError(
            f"cfg_parallel=True needs an even world size (the two CFG branches run on two halves), got "
            f"world_size({world_size}); {_what_works(world_size, num_heads)}"
        )
    if cfg_parallel is None:
        if sp_size is None:
            halves = world_size % CFG_DEGREE == 0 and (world_size // CFG_DEGREE) % sp_multiple == 0
            cfg_degree = CFG_DEGREE if halves else 1
        elif sp_size * CFG_DEGREE == world_size:
            cfg_degree = CFG_DEGREE
        else:
            cfg_degree = 1
    else:
        cfg_degree = CFG_DEGREE if cfg_parallel else 1
    if sp_size is None:
        sp_size = world_size // cfg_degree
    # heads are checked on the whole layout, once ring_size is known (ring attention takes what Ulysses cannot)
    return ParallelLayout(world_size=world_size, sp_size=sp_size, cfg_degree=cfg_degree)


def valid_layouts(world_size: int, num_heads: int | None = None) -> list[tuple[int, int]]:
    """Every (cfg_degree, sp_size) that fits `world_size` ranks. Any head count fits: ring attention takes the part of
    sp that Ulysses cannot (`num_heads` is kept for the messages' sake)."""
    return [(cfg, world_size // cfg) for cfg in (CFG_DEGREE, 1) if world_size % cfg == 0]


def _what_works(world_size: int, num_heads: int | None) -> str:
    heads = f" and {num_heads} heads" if num_heads is not None else ""
    shown = " or ".join(f"sp_size={sp}, cfg_parallel={cfg > 1}" for cfg, sp in valid_layouts(world_size, num_heads))
    return f"with {world_size} rank(s){heads} use {shown}"

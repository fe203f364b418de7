"""Slurm's own value formats, parsed as pure functions: tasks per node (``2(x3),1``), compressed host lists
(``gpu-a[01,03],gpu-b7``) and the rendezvous port derived from a job id."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

# The derived MASTER_PORT stays below Linux's ephemeral range (32768-60999) so it does not collide with the
# source port of some outgoing connection on the rank-0 host.
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 12000

# Slurm itself refuses larger ranges in a host list.
_MAX_HOSTLIST_RANGE = 65536

_TASKS_PER_NODE_ENTRY = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_RANGE_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def parse_slurm_tasks_per_node(name: str, raw: str) -> int | None:
    """Tasks per node from Slurm's ``N``, ``N(xM)`` or a comma list of those; None when the nodes differ.

    A list whose entries all have the same N (``2,2`` or ``2(x3),2``) counts as uniform N: Slurm writes runs of
    equal counts as ``N(xM)``, but a list of equal counts means the same thing. ``name`` is only used in errors.
    """
    counts: set[int] = set()
    for entry in raw.split(","):
        match = _TASKS_PER_NODE_ENTRY.fullmatch(entry.strip())
        if match is None or (match.group(2) is not None and int(match.group(2)) < 1):
            raise ValueError(
                f"{name}={raw!r} is not a Slurm tasks-per-node value; expected N, N(xM) or a comma list of "
                "those, such as '4' or '2(x3),1'"
            )
        counts.add(int(match.group(1)))
    return counts.pop() if len(counts) == 1 else None


# --- Slurm host lists ----------------------------------------------------------------------------------------


def _split_top_level(value: str) -> list[str]:
    """Split at commas outside brackets: ``a[1,3],b`` is two hosts, not three."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(value):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in Slurm host list {value!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"']' without '[' in Slurm host list {value!r}")
        elif char == "," and depth == 0:
            parts.append(value[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"'[' without ']' in Slurm host list {value!r}")
    parts.append(value[start:])
    return parts


def _parse_bracket(body: str, value: str) -> list[tuple[int, int, int]]:
    """``07-10,12`` -> [(7, 10, 2), (12, 12, 2)]: (low, high, digits to zero-pad to)."""
    ranges: list[tuple[int, int, int]] = []
    for item in body.split(","):
        match = _RANGE_ITEM.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"[{body}] in Slurm host list {value!r} is not a list of numbers and ranges like 1-4")
        low_text, high_text = match.group(1), match.group(2)
        low = int(low_text)
        high = low if high_text is None else int(high_text)
        if high < low:
            raise ValueError(f"range {item.strip()} in Slurm host list {value!r} runs backwards")
        if high - low >= _MAX_HOSTLIST_RANGE:
            raise ValueError(f"range {item.strip()} in Slurm host list {value!r} is too large")
        ranges.append((low, high, len(low_text)))
    return ranges


def _parse_pattern(pattern: str, value: str) -> list[str | list[tuple[int, int, int]]]:
    """``gpu-a[01,03]x[1-2]`` -> ['gpu-a', [(1, 1, 2), (3, 3, 2)], 'x', [(1, 2, 1)]]."""
    pieces: list[str | list[tuple[int, int, int]]] = []
    for i, chunk in enumerate(re.split(r"[\[\]]", pattern)):
        if i % 2 == 0:
            if chunk:
                pieces.append(chunk)
        else:
            pieces.append(_parse_bracket(chunk, value))
    if not any(isinstance(piece, str) for piece in pieces):
        raise ValueError(f"host pattern {pattern!r} in Slurm host list {value!r} has no name")
    return pieces


def _expand_pattern(pieces: Sequence[str | list[tuple[int, int, int]]]) -> Iterator[str]:
    """Lazily, so the first host of a very large list costs nothing."""
    if not pieces:
        yield ""
        return
    head, rest = pieces[0], pieces[1:]
    if isinstance(head, str):
        heads: Iterator[str] = iter((head,))
    else:
        heads = (str(n).zfill(width) for low, high, width in head for n in range(low, high + 1))
    for prefix in heads:
        for suffix in _expand_pattern(rest):
            yield prefix + suffix


def _iter_slurm_hostlist(value: str) -> Iterator[str]:
    text = value.strip()
    if not text:
        return
    patterns = [pattern.strip() for pattern in _split_top_level(text)]
    if any(not pattern for pattern in patterns):
        raise ValueError(f"empty host name in Slurm host list {value!r}")
    if any(char.isspace() for pattern in patterns for char in pattern):
        raise ValueError(f"white space inside a host name in Slurm host list {value!r}")
    parsed = [_parse_pattern(pattern, value) for pattern in patterns]  # reject a bad list before yielding anything
    for pieces in parsed:
        yield from _expand_pattern(pieces)


def expand_slurm_hostlist(value: str) -> list[str]:
    """Expand a Slurm compressed host list: ``gpu-a[01,03],gpu-b7`` -> ['gpu-a01', 'gpu-a03', 'gpu-b7'].

    Ranges keep the zero padding of their low end (``n[07-10]`` -> n07..n10); several bracket groups in one name
    give every combination in order (``a[1-2]b[3-4]`` -> a1b3, a1b4, a2b3, a2b4). Raises ValueError on a
    malformed list; a blank value gives [].
    """
    return list(_iter_slurm_hostlist(value))


def first_slurm_host(value: str) -> str:
    """The first host of a Slurm compressed host list (``n[3-4]`` -> n3), without expanding the rest."""
    for host in _iter_slurm_hostlist(value):
        return host
    raise ValueError(f"Slurm host list {value!r} names no host")


def slurm_port_for_job(job_id: int) -> int:
    """A rendezvous port every task of a Slurm job derives alike from its job id, without Python's salted hash."""
    return _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN

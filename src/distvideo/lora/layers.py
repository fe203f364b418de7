"""LoRA adapters on one model's linear layers: checking a file against the model, merging into the weights from a saved
copy of the base weights, and applying on the fly with forward hooks while unmerged.

Exactness is the rule: the base weights of every touched layer are kept (on the CPU) and every merge writes
``W_base + sum(strength * delta)`` computed from that copy, never by adding to or subtracting from the live weights, so
any number of merge/unmerge/switch cycles ends bit-identical to the base when the adapters are cleared.

Under sharded weights (FSDP2, parallel/shard.py) a parameter is a DTensor split on dim 0 and a rank holds a slice of
its rows: the same code keeps and writes only those rows (lora/sharded.py `local_rows`), from the full delta computed
on every rank, so the gathered weights equal the unsharded merge bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distvideo.lora.formats import LoraError, LoraFile, LoraLayerWeights
from distvideo.lora.sharded import local_rows, reshard
from distvideo.models.quantize import is_low_precision

logger = logging.getLogger(__name__)


@dataclass
class LoraAdapter:
    """A LoRA file checked against a model: every layer exists, is linear, and has the right shapes."""

    nickname: str
    path: str
    sha256: str
    layers: dict[str, LoraLayerWeights]
    layout: str

    @property
    def rank(self) -> int:
        return max((w.rank for w in self.layers.values()), default=0)

    @property
    def nbytes(self) -> int:
        tensors = [t for w in self.layers.values() for t in (w.down, w.up, w.diff, w.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def describe(self) -> dict[str, Any]:
        return {
            "nickname": self.nickname,
            "path": self.path,
            "sha256": self.sha256,
            "layers": len(self.layers),
            "rank": self.rank,
            "layout": self.layout,
        }


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear of `model` by its qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _expected_names(linears: dict[str, nn.Linear], limit: int = 8) -> str:
    names = list(linears)
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[: limit - 2]) + f", ..., {names[-1]} ({len(names)} linear layers)"


def check_against_model(file: LoraFile, linears: dict[str, nn.Linear], nickname: str) -> LoraAdapter:
    """A LoraAdapter for `file` if every layer it names is a linear layer of the model with matching shapes."""
    unmatched = sorted(name for name in file.layers if name not in linears)
    if unmatched and len(unmatched) == len(file.layers):
        raise LoraError(
            f"LoRA file {file.path!r} ({file.layout} keys) matches no layer of this model's transformer: it is "
            f"probably for another model. Its layers: {', '.join(unmatched[:4])}"
            f"{', ...' if len(unmatched) > 4 else ''}; this model's linear layers: {_expected_names(linears)}"
        )
    if unmatched:
        shown = ", ".join(unmatched[:5]) + (f" (and {len(unmatched) - 5} more)" if len(unmatched) > 5 else "")
        raise LoraError(
            f"LoRA file {file.path!r} ({file.layout} keys): {len(unmatched)} of its {len(file.layers)} layers match "
            f"no linear layer of this model's transformer: {shown}. This model's linear layers: "
            f"{_expected_names(linears)}. Is the file for a model with more blocks or another architecture?"
        )
    for name, weights in file.layers.items():
        layer = linears[name]
        out_f, in_f = layer.out_features, layer.in_features
        problems = []
        if weights.down is not None and weights.down.shape[1] != in_f:
            problems.append(f"lora_A/lora_down has shape {tuple(weights.down.shape)}, expected (rank, {in_f})")
        if weights.up is not None and weights.up.shape[0] != out_f:
            problems.append(f"lora_B/lora_up has shape {tuple(weights.up.shape)}, expected ({out_f}, rank)")
        if weights.diff is not None and tuple(weights.diff.shape) != (out_f, in_f):
            problems.append(f"the weight delta has shape {tuple(weights.diff.shape)}, expected ({out_f}, {in_f})")
        if weights.bias is not None:
            if layer.bias is None:
                problems.append("the file has a bias delta but the layer has no bias")
            elif tuple(weights.bias.shape) != (out_f,):
                problems.append(f"the bias delta has shape {tuple(weights.bias.shape)}, expected ({out_f},)")
        if problems:
            raise LoraError(
                f"LoRA file {file.path!r}: layer {name} is Linear(in_features={in_f}, out_features={out_f}) in this "
                f"model, but {'; '.join(problems)}. The file is for a model of another size."
            )
    return LoraAdapter(nickname=nickname, path=file.path, sha256=file.sha256, layers=file.layers, layout=file.layout)


@dataclass
class _Pending:
    """A prepared, validated change (phase 1 of set_lora_adapter), not yet applied."""

    nickname: str
    adapter: LoraAdapter | None  # None: switch to the cached adapter of that nickname
    active: list[tuple[str, float]]


@dataclass
class _Undo:
    active: list[tuple[str, float]]
    merged: bool
    cache: dict[str, LoraAdapter]


@dataclass
class _Term:
    """One adapter's contribution to one layer: scale * (x @ down^T @ up^T + x @ diff^T + bias)."""

    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    diff: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    scale: float = 1.0


@dataclass
class _OnTheFly:
    """A forward hook adding the active adapters' terms to a linear layer's output (the unmerged mode), computed in
    float32 like a merged float32 weight would be."""

    terms: list[_Term]

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        x = inputs[0].to(torch.float32)
        if self.terms and _term_device(self.terms[0]) != x.device:  # the layer moved (an expert swapped on CUDA)
            device = x.device
            self.terms = [
                _Term(_to(t.down, device), _to(t.up, device), _to(t.diff, device), _to(t.bias, device), t.scale)
                for t in self.terms
            ]
        extra: torch.Tensor | None = None
        for t in self.terms:
            part = F.linear(F.linear(x, t.down), t.up) if t.down is not None and t.up is not None else None
            if t.diff is not None:
                part = F.linear(x, t.diff, t.bias) if part is None else part + F.linear(x, t.diff, t.bias)
            elif t.bias is not None:
                part = t.bias if part is None else part + t.bias
            if part is None:
                continue
            part = part * t.scale
            extra = part if extra is None else extra + part
        return output if extra is None else output + extra.to(output.dtype)


def _term_device(term: _Term) -> torch.device | None:
    first = next((v for v in (term.down, term.up, term.diff, term.bias) if v is not None), None)
    return first.device if first is not None else None


def _to(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return x.to(device) if x is not None else None


@dataclass
class LoraState:
    """The LoRA state of one model on one rank: cached adapters, the active ones, merged or applied on the fly. On a
    quantized base (--quantize) the adapters always apply on the fly, as a separate full-precision path beside the
    quantized layers: merging would round the adapter into the base's 8 bits, and the base stays as loaded."""

    model: nn.Module
    linears: dict[str, nn.Linear] = field(default_factory=dict)
    cache: dict[str, LoraAdapter] = field(default_factory=dict)
    active: list[tuple[str, float]] = field(default_factory=list)  # (nickname, strength), in stacking order
    merged: bool = True
    pending: _Pending | None = None
    cache_bytes: int = 1024 * 2**20  # LRU limit of the adapter cache (active adapters always stay)
    _base: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)  # CPU copies
    _hooks: list[Any] = field(default_factory=list)
    _undo: _Undo | None = None
    separate: bool = field(default=False, init=False)  # set from the base's weights

    def __post_init__(self) -> None:
        if not self.linears:
            self.linears = linear_layers(self.model)
        self.separate = any(is_low_precision(layer.weight) for layer in self.linears.values())
        self.merged = self.merged and not self.separate

    # -- phase 1: prepare (no weight changes) -----------------------------------------------------
    def prepare(
        self,
        nickname: str,
        load: Callable[[], LoraFile] | None,
        strength: float,
        accumulate: bool,
    ) -> dict[str, Any]:
        """Load and check an adapter (or find the cached one when `load` is None) and remember the change."""
        self.pending = None
        if any(getattr(m, "fused_projections", False) for m in self.model.modules()):
            # fused q/k/v projections bypass the to_q/to_k/to_v layers a LoRA changes
            raise RuntimeError(
                "LoRA adapters need unfused attention projections; call unfuse_projections() on the attention modules"
            )
        adapter: LoraAdapter | None = None
        if load is not None:
            adapter = check_against_model(load(), self.linears, nickname)
            described = adapter.describe()
        elif nickname in self.cache:
            described = self.cache[nickname].describe()
        else:
            cached = ", ".join(repr(n) for n in self.cache) or "none"
            raise LoraError(
                f"no LoRA adapter named {nickname!r} is loaded (loaded: {cached}); pass its path the first time, "
                f"e.g. set_lora_adapter({nickname!r}, path='adapter.safetensors')"
            )
        if accumulate:
            active = [(n, s) for n, s in self.active if n != nickname] + [(nickname, strength)]
        else:
            active = [(nickname, strength)]
        self.pending = _Pending(nickname=nickname, adapter=adapter, active=active)
        return described

    def abort(self) -> None:
        self.pending = None

    # -- phase 2: commit and the other transitions -------------------------------------------------
    def commit(self) -> None:
        if self.pending is None:
            raise RuntimeError("no prepared LoRA change to commit (prepare failed or was aborted)")
        pending, self.pending = self.pending, None
        cache = dict(self.cache)
        adapter = pending.adapter if pending.adapter is not None else cache.pop(pending.nickname)
        cache[pending.nickname] = adapter  # the most recently used last
        self.transition(pending.active, merged=True, cache=self._bounded(cache, pending.active))

    def _bounded(self, cache: dict[str, LoraAdapter], active: list[tuple[str, float]]) -> dict[str, LoraAdapter]:
        """The cache within `cache_bytes`: the least recently used adapters that are not active are dropped."""
        keep = {nickname for nickname, _ in active}
        bounded = dict(cache)
        for nickname in list(bounded):
            if sum(a.nbytes for a in bounded.values()) <= self.cache_bytes:
                break
            if nickname not in keep:
                del bounded[nickname]
                logger.info(
                    "LoRA adapter %r dropped from the cache (least recently used; cache limit %d MiB)",
                    nickname,
                    self.cache_bytes // 2**20,
                )
        return bounded

    def remove(self, nickname: str) -> None:
        """Drop a cached adapter that is not active (no weight changes)."""
        if nickname not in self.cache:
            cached = ", ".join(repr(n) for n in self.cache) or "none"
            raise LoraError(f"remove_lora_adapter({nickname!r}): no such adapter is cached (cached: {cached})")
        if any(n == nickname for n, _ in self.active):
            raise LoraError(
                f"remove_lora_adapter({nickname!r}): the adapter is active; switch to another one or call "
                "clear_lora_adapters() first"
            )
        del self.cache[nickname]

    def transition(
        self, active: list[tuple[str, float]], *, merged: bool, cache: dict[str, LoraAdapter] | None = None
    ) -> None:
        """Move to a new set of active adapters / merge mode; on a failure this rank returns to where it was. The
        previous state is kept until the next transition, so `rollback` can undo this one on every rank."""
        undo = _Undo(active=list(self.active), merged=self.merged, cache=dict(self.cache))
        try:
            if cache is not None:
                self.cache = cache
            self._apply(active, merged)
        except BaseException:
            self._undo = None  # this rank is back where it was: a later rollback must not undo an older change
            self._restore_state(undo)
            raise
        self._undo = undo

    def forget_undo(self) -> None:
        """Drop what `rollback` would undo: a transition on another model of the same worker is about to happen, and
        a rollback after it must not undo an older change of this one."""
        self._undo = None

    def rollback(self) -> None:
        """Undo the last transition (after it failed on another rank); a no-op when there is none."""
        undo, self._undo = self._undo, None
        self.pending = None
        if undo is not None:
            self._restore_state(undo)

    def _restore_state(self, undo: _Undo) -> None:
        self.cache = undo.cache
        self._apply(undo.active, undo.merged)

    # -- weights -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _apply(self, active: list[tuple[str, float]], merged: bool) -> None:
        touched = {name for nickname, _ in active for name in self.cache[nickname].layers}
        if self.separate:  # a quantized base: its weights never change
            self._remove_hooks()
            self._install_hooks(active, touched)
            self.active, self.merged = list(active), False
            return
        reshard(self.model)  # sharded weights: write the shards, not a gathered copy
        for name in list(self._base):  # layers no adapter touches any more: base weights back, copy dropped
            if name not in touched:
                self._write_base(name)
                del self._base[name]
        for name in sorted(touched - self._base.keys()):  # under sharding: only this rank's rows
            layer = self.linears[name]
            weight = local_rows(layer.weight)[0].detach().to("cpu", copy=True)
            bias = local_rows(layer.bias)[0].detach().to("cpu", copy=True) if layer.bias is not None else None
            self._base[name] = (weight, bias)
        self._remove_hooks()
        for name in sorted(touched):
            if merged:
                self._write_merged(name, active)
            else:
                self._write_base(name)
        if not merged:
            self._install_hooks(active, touched)
        self.active, self.merged = list(active), merged

    def _write_base(self, name: str) -> None:
        layer = self.linears[name]
        weight, bias = self._base[name]
        local_rows(layer.weight)[0].copy_(weight)
        if bias is not None and layer.bias is not None:
            local_rows(layer.bias)[0].copy_(bias)

    def _write_merged(self, name: str, active: list[tuple[str, float]]) -> None:
        # The deltas are computed whole, by the unsharded expression, on every rank; a rank adds the rows it holds
        # (all of them without sharding), so its shard is exactly those rows of the unsharded merge.
        layer = self.linears[name]
        local_weight, rows = local_rows(layer.weight)
        local_bias, bias_rows = local_rows(layer.bias) if layer.bias is not None else (None, rows)
        device = local_weight.device
        base_weight, base_bias = self._base[name]
        weight = base_weight.to(device, torch.float32)
        bias = base_bias.to(device, torch.float32) if base_bias is not None else None
        for nickname, strength in active:
            w = self.cache[nickname].layers.get(name)
            if w is None or strength == 0.0:
                continue  # strength 0 leaves the base bits untouched
            if w.down is not None and w.up is not None:
                weight = weight + ((w.up.to(device) @ w.down.to(device)) * (strength * w.scale))[rows]
            if w.diff is not None:
                weight = weight + w.diff.to(device)[rows] * strength
            if w.bias is not None and bias is not None:
                bias = bias + w.bias.to(device)[bias_rows] * strength
        local_weight.copy_(weight)
        if bias is not None and local_bias is not None:
            local_bias.copy_(bias)

    def _install_hooks(self, active: list[tuple[str, float]], touched: set[str]) -> None:
        for name in sorted(touched):
            layer = self.linears[name]
            device = layer.weight.device
            terms: list[_Term] = []
            for nickname, strength in active:
                w = self.cache[nickname].layers.get(name)
                if w is None or strength == 0.0:
                    continue
                if w.down is not None and w.up is not None:
                    terms.append(_Term(down=w.down.to(device), up=w.up.to(device), scale=strength * w.scale))
                if w.diff is not None or w.bias is not None:
                    diff = w.diff.to(device) if w.diff is not None else None
                    bias = w.bias.to(device) if w.bias is not None else None
                    terms.append(_Term(diff=diff, bias=bias, scale=strength))
            if terms:
                # first among the layer's hooks: the term belongs to the layer's own output, before a plan's hook
                # changes it (the Ulysses plan gathers proj_out's output over the sequence-parallel ranks)
                self._hooks.append(layer.register_forward_hook(_OnTheFly(terms), prepend=True))

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def describe(self) -> dict[str, Any]:
        return {
            "active": [list(a) for a in self.active],
            "merged": self.merged,
            "separate": self.separate,  # adapters on a quantized base: a full-precision path, never merged
            "cached": sorted(self.cache),
            "touched_layers": len(self._base),
        }

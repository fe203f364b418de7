"""What a model family is: the checkpoints it answers to, the pipeline that runs it, what it loads, its request
defaults and the traits the plans read. Families declare themselves in their own package (distvideo/families/<name>/)
and register here (`register_family`); models/registry.py matches checkpoints against what is registered."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distvideo.models.registry import ModelInfo
    from distvideo.request import ResolvedRequest

IMAGE_NONE, IMAGE_OPTIONAL, IMAGE_REQUIRED = "none", "optional", "required"


@dataclass(frozen=True)
class CachePoints:
    """Where a family's transformer takes the step cache (pipelines/caching/): the attribute holding its blocks, and
    whether each block also takes and returns the text stream (`text_stream`: a dual-stream block, called as
    ``block(hidden_states, encoder_hidden_states, ...)`` and returning both). Only the video stream's residual is
    cached and replayed: a skipped block hands the text stream on unchanged, which is exact because the transformer
    reads nothing of the text stream after its last block."""

    blocks: str
    text_stream: bool = False

    def video(self, out: Any) -> Any:
        """The video stream of a block's output."""
        return out[0] if self.text_stream else out

    def passed_on(self, hidden_states: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What a skipped block returns: `hidden_states`, with the block's text stream input beside it."""
        if not self.text_stream:
            return hidden_states
        text = args[0] if args else kwargs["encoder_hidden_states"]
        return hidden_states, text


@dataclass(frozen=True)
class ModelFamily:
    """One model family: which checkpoints it is (the `model_index.json` class and the traits read from it), which
    pipeline runs it, what it loads and which request defaults it documents.

    A checkpoint belongs to the family whose `class_names` hold its `_class_name` and whose traits equal the
    checkpoint's: `experts` (2 when `transformer_2` is a component), `expand_timesteps` (per-token timesteps) and
    `image_encoder` (a CLIP image encoder is a component)."""

    name: str  # as messages say it, e.g. "Wan2.2 TI2V-5B"
    class_names: tuple[str, ...]
    pipeline: str  # "module:Class" of its pipeline (a pipelines.base.DenoisingPipeline), imported by the worker
    components: tuple[str, ...]
    defaults: dict[str, Any]
    description: str
    #: a hub id of one of its checkpoints, for messages that say how to get one ("" for none)
    example_checkpoint: str = ""
    image: str = IMAGE_NONE  # whether a request takes an image: "none" | "optional" | "required"
    experts: int = 1
    expand_timesteps: bool = False
    image_encoder: bool = False
    #: "module:Class" of the exact plan that compacts its text padding (built per transformer as
    #: ``Class(component=name)``, models/plans.py); None: it has none, and `compact_text_off` says why
    compact_text: str | None = None
    compact_text_off: str = "it declares no compact-text plan"
    #: (image rows, image columns, transformer config) -> (height, width) of a request that sets neither; None: the
    #: family's default size
    size_for_image: Callable[[int, int, dict[str, Any]], tuple[int, int]] | None = None
    #: (checkpoint folder, model_index.json, transformer config) -> request defaults the checkpoint itself sets (read
    #: before any weight; raises ConfigError on what the family cannot run); None: only the documented ones
    checkpoint_defaults: Callable[[Path, dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    text_tokens: int = 512  # text tokens a step attends to (the layout planner's cost model): Wan pads to 512
    #: (checkpoint, resolved request, the transformer's input shape) -> matmul FLOPs of one forward by part (the
    #: bench's MFU; models/flops.py says what counts); None: the bench reports no FLOP figures for the family
    transformer_flops: Callable[[ModelInfo, ResolvedRequest, Sequence[int]], dict[str, int]] | None = None
    #: (module, class names) its checkpoints' components come from: imported once by the mp executor's fork server
    #: (models/preload.py), so forked workers start with them
    libraries: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: where --cache wraps the transformer (None: the family's blocks are not declared, and --cache is refused before
    #: loading); Wan's single-stream `blocks` by default
    cache_points: CachePoints | None = CachePoints("blocks")
    #: the transformer's layers --quantize leaves in full precision (regular expressions searched in module names,
    #: as diffusers' layerwise casting reads them): Wan's patch and condition embeddings, norms, output projection
    full_precision: tuple[str, ...] = ("patch_embedding", "condition_embedder", "norm", "^proj_out$")

    @property
    def takes_image(self) -> bool:
        """Whether a request may bring a conditioning image."""
        return self.image != IMAGE_NONE

    @property
    def transformers(self) -> tuple[str, ...]:
        """The denoising transformers' component names, the high-noise expert first."""
        return ("transformer", "transformer_2")[: self.experts]

    @property
    def traits(self) -> tuple[int, bool, bool]:
        return self.experts, self.expand_timesteps, self.image_encoder


_FAMILIES: list[ModelFamily] = []


def register_family(*families: ModelFamily) -> None:
    """Add families to the registry, in the order checkpoints are matched; registering the same declaration again (a
    module imported twice) changes nothing, another family under a registered name is refused."""
    for family in families:
        known = next((f for f in _FAMILIES if f.name == family.name), None)
        if known is None:
            _FAMILIES.append(family)
        elif known != family:
            raise ValueError(f"a model family named {family.name!r} is already registered")


def registered_families() -> tuple[ModelFamily, ...]:
    return tuple(_FAMILIES)


def declared(path: str) -> Any:
    """What a family declaration names as "module:Name" (its pipeline class, its plans), imported."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)

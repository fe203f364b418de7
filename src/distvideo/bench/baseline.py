"""diffusers' WanPipeline (or the checkpoint's HunyuanVideo 1.5 pipeline) in a child process (its memory peak is its
own), timed stage by stage, run on demand by the bench on the same checkpoint, shape, seed, device, dtypes and thread
count as distvideo."""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any

from distvideo.devices import peak_memory_mb, reset_peak_memory
from distvideo.request import ResolvedRequest

logger = logging.getLogger("distvideo.cli")


@dataclass
class DiffusersSpec:
    model: str
    device: str
    dtypes: dict[str, str]  # component -> torch dtype name, as the distvideo rank uses
    threads: int
    pipeline: str = "WanPipeline"  # the diffusers class: WanImageToVideoPipeline for requests with an image


class _DiffusersTimer:
    """diffusers' WanPipeline with its stages timed by wrapping its components (it has no timings of its own):
    text encoding = `pipe.encode_prompt`; denoising = from the first transformer forward (a forward pre-hook) to
    the start of `pipe.vae.decode` (the loop with its scheduler steps, and the latent unscaling after it);
    decoding = `pipe.vae.decode`."""

    def __init__(self, spec: DiffusersSpec):
        import json
        import warnings
        from pathlib import Path

        import diffusers
        import torch
        import transformers

        from distvideo.models import compat

        compat.defer_torchao()  # the reference loads as distvideo does (no torchao import, which times nothing)
        for library in (diffusers, transformers):
            library.utils.logging.set_verbosity_error()
            library.utils.logging.disable_progress_bar()
        self.device = torch.device(spec.device)
        dtypes = {name: getattr(torch, value) for name, value in spec.dtypes.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch_dtype -> dtype rename; older diffusers need it
            vae_class = json.loads((Path(spec.model) / "model_index.json").read_text())["vae"][1]  # the checkpoint's
            vae = getattr(diffusers, vae_class).from_pretrained(spec.model, subfolder="vae", torch_dtype=dtypes["vae"])
            pipe = getattr(diffusers, spec.pipeline).from_pretrained(
                spec.model, vae=vae, torch_dtype=dtypes["transformer"]
            )
        pipe.text_encoder.to(dtypes["text_encoder"])
        if getattr(pipe, "image_encoder", None) is not None:
            pipe.image_encoder.to(dtypes.get("image_encoder", dtypes["vae"]))
        pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe
        self.marks: dict[str, float] = {}
        self.forwards = 0
        self._wrap(pipe, "encode_prompt", "text_encoding")
        self._wrap(pipe.vae, "decode", "decoding")
        for expert in (pipe.transformer, getattr(pipe, "transformer_2", None)):
            if expert is not None:
                expert.register_forward_pre_hook(self._on_transformer_forward)

    def _now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _wrap(self, owner: Any, attr: str, stage: str) -> None:
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.marks[f"{stage}_start"] = self._now()
            out = original(*args, **kwargs)
            self.marks[f"{stage}_end"] = self._now()
            return out

        object.__setattr__(owner, attr, timed)  # an instance attribute shadows the method (nn.Module too)

    def _on_transformer_forward(self, module: Any, args: Any) -> None:
        self.forwards += 1
        if "denoising_start" not in self.marks:
            self.marks["denoising_start"] = self._now()

    def run(self, request: ResolvedRequest, return_frames: bool) -> dict[str, Any]:
        import numpy as np
        import torch

        self.marks, self.forwards = {}, 0
        family_kwargs: dict[str, Any] = {}
        if request.image is not None:
            from PIL import Image

            family_kwargs["image"] = Image.fromarray(np.asarray(request.image))
        if request.guidance_scale_2 is not None:
            family_kwargs["guidance_scale_2"] = request.guidance_scale_2
        if request.boundary_ratio is not None:
            self.pipe.register_to_config(boundary_ratio=request.boundary_ratio)
        if type(self.pipe).__name__.startswith("HunyuanVideo15"):  # the scale is its guider's; I2V sizes itself
            from diffusers import ClassifierFreeGuidance

            self.pipe.guider = ClassifierFreeGuidance(guidance_scale=request.guidance_scale)
            if request.image is None:
                family_kwargs.update(height=request.height, width=request.width)
        else:
            family_kwargs.update(
                height=request.height,
                width=request.width,
                guidance_scale=request.guidance_scale,
                max_sequence_length=request.max_sequence_length,
            )
        metric = reset_peak_memory(self.device)
        start = self._now()
        video = self.pipe(
            prompt=request.prompt,
            **family_kwargs,
            negative_prompt=request.negative_prompt,
            num_frames=request.num_frames,
            num_inference_steps=request.num_inference_steps,
            generator=torch.Generator("cpu").manual_seed(request.seed),
            output_type="np",
        ).frames[0]
        e2e = self._now() - start
        m = self.marks
        stages = {
            "text_encoding": m["text_encoding_end"] - m["text_encoding_start"],
            "denoising": m["decoding_start"] - m["denoising_start"],
            "decoding": m["decoding_end"] - m["decoding_start"],
        }
        stages["denoising_per_step"] = stages["denoising"] / max(1, request.num_inference_steps or 1)
        out: dict[str, Any] = {
            "e2e_s": e2e,
            "stages": stages,
            "peak_memory_mb": peak_memory_mb(self.device),
            "memory_metric": metric,
            "transformer_forwards": self.forwards,
        }
        if return_frames:
            out["frames"] = np.round(np.asarray(video) * 255).astype(np.uint8)
        return out


def _diffusers_process(conn: Any) -> None:
    """Entry point of the child process: import the libraries (while the parent loads distvideo), then take
    ("load", spec), say ready, and answer ("run", request, frames?) until ("close",) or the parent goes away."""
    try:
        import diffusers  # noqa: F401  (the slow imports, before the spec arrives)
        import torch

        message = conn.recv()
        if message[0] != "load":
            return
        spec = message[1]
        torch.set_num_threads(spec.threads)
        timer = _DiffusersTimer(spec)
        conn.send(("ready", {"threads": torch.get_num_threads()}))
        while True:
            message = conn.recv()
            if message[0] == "close":
                return
            _, request, return_frames = message
            conn.send(("ok", timer.run(request, return_frames)))
    except BaseException as exc:  # report, then exit: the parent raises it
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except Exception:
            pass
    finally:
        conn.close()


class DiffusersBaseline:
    """A diffusers WanPipeline in a spawned process, run on demand; its memory peak is its own. The process starts
    (and imports torch and diffusers) at construction; `load` gives it the checkpoint, device and threads."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_diffusers_process, args=(child_conn,), daemon=True, name="diffusers")
        self._proc.start()
        child_conn.close()
        self.loaded = False

    def load(self, spec: DiffusersSpec) -> None:
        self._conn.send(("load", spec))
        self._receive("loading")
        self.loaded = True

    def _receive(self, what: str) -> Any:
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"the diffusers process died while {what} (exit code {self._proc.exitcode})")
        try:
            message = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the diffusers process closed its pipe while {what}") from None
        if message[0] == "error":
            logger.debug("diffusers process traceback:\n%s", message[2])
            raise RuntimeError(f"diffusers baseline failed while {what}: {message[1]}")
        return message[1]

    def run(self, request: ResolvedRequest, return_frames: bool = False) -> dict[str, Any]:
        self._conn.send(("run", request, return_frames))
        return self._receive("generating")

    def close(self) -> None:
        if self._conn.closed:
            return
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except OSError:
                pass
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

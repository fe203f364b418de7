"""The offload phase of benchmarks/gpu_check.py, and the weight sizes docs/performance.md's offload table gives.

The phase (CUDA only; skipped in --smoke mode): on the 1.3B-shaped checkpoint, one engine per `--offload` mode
(none, text, model), one request each at the first timed shape with a few steps (the peak does not depend on the
step count): the device memory allocated after loading (the weights that stay on the device), the request's peak
(`torch.cuda.max_memory_allocated`, the worker's figure), the text-encoding and decoding times (which include the
copies), and the frames against offload=none, which must be byte-identical (the same tensors copied both ways).
It also checks the mechanism: the device memory a mode saves after loading must be (at least 90% of) the weight bytes
of the components it offloads; a reference left on the device would show here. The checkpoint's VAE has the real
Wan2.1 shape (0.51 GB in float32), but its text encoder is a 2-layer UMT5 of width 4096 with a 512-token vocabulary
and d_ff 1024 (36M parameters, 71 MB in bfloat16), not the real 5.7B-parameter one: the saving it measures for the
text encoder is that small encoder's; the real one's weights are in the table `--weights` prints.

    python benchmarks/gpu_check_offload.py --weights   # the table of weight sizes, from the published configs
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

MODES = ("none", "text", "model")
PHASE_STEPS = 2
PROMPT = "a red fox running through snow"

# The published configs (config.json of the Wan-AI/*-Diffusers repositories) of the components offload moves, and of
# the transformers it leaves on the device; the parameters are counted on the meta device (no weights, no download).
UMT5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=256384,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, tie_word_embeddings=False)  # fmt: skip
CLIP_VIT_H = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                  patch_size=14, image_size=224, projection_dim=1024)  # fmt: skip
WAN21_VAE: dict[str, Any] = {}  # AutoencoderKLWan's defaults are Wan2.1's VAE (base_dim 96, z_dim 16)
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                 patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)  # fmt: skip
WAN_14B = dict(num_layers=40, num_attention_heads=40, attention_head_dim=128, ffn_dim=13824)
TRANSFORMERS = {
    "Wan2.1-T2V-1.3B": dict(num_layers=30, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960),
    "Wan2.1-T2V-14B, one Wan2.2 T2V-A14B expert": WAN_14B,
    "Wan2.1-I2V-14B": dict(WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    "one Wan2.2 I2V-A14B expert": dict(WAN_14B, in_channels=36),
    "Wan2.2 TI2V-5B": dict(
        num_layers=30, num_attention_heads=24, attention_head_dim=128, ffn_dim=14336, in_channels=48, out_channels=48
    ),
}
TEXT, CLIP, VAE21, VAE22 = "UMT5-XXL text encoder", "CLIP ViT-H/14 image encoder", "Wan2.1 VAE", "Wan2.2 VAE"
#: each model's components: (transformers, image encoder or None, VAE); every one has the UMT5-XXL text encoder
MODELS = {
    "Wan2.1-T2V-1.3B": (["Wan2.1-T2V-1.3B"], None, VAE21),
    "Wan2.1-T2V-14B": (["Wan2.1-T2V-14B, one Wan2.2 T2V-A14B expert"], None, VAE21),
    "Wan2.1-I2V-14B": (["Wan2.1-I2V-14B"], CLIP, VAE21),
    "Wan2.2-T2V-A14B": (["Wan2.1-T2V-14B, one Wan2.2 T2V-A14B expert"] * 2, None, VAE21),
    "Wan2.2-I2V-A14B": (["one Wan2.2 I2V-A14B expert"] * 2, None, VAE21),
    "Wan2.2-TI2V-5B": (["Wan2.2 TI2V-5B"], None, VAE22),
}
#: bytes per parameter on a GPU (devices.component_dtypes): float32 for the VAE and the image encoder
FLOAT32 = (CLIP, VAE21, VAE22)


def _parameters(build: Callable[[], torch.nn.Module]) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def component_parameters() -> dict[str, int]:
    """Parameter counts of the components, from the configs above."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    counts = {
        TEXT: _parameters(lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL))),
        CLIP: _parameters(lambda: CLIPVisionModel(CLIPVisionConfig(**CLIP_VIT_H))),
        VAE21: _parameters(lambda: AutoencoderKLWan(**WAN21_VAE)),
        VAE22: _parameters(lambda: AutoencoderKLWan(**WAN22_VAE)),
    }
    for name, config in TRANSFORMERS.items():
        counts[name] = _parameters(lambda config=config: WanTransformer3DModel(**config))
    return counts


def weights_table() -> str:
    """The components' weights, then what each model keeps on the device per offload mode (weights only)."""
    counts = component_parameters()
    size = {name: n * (4 if name in FLOAT32 else 2) / 1e9 for name, n in counts.items()}
    lines = ["| component | parameters | dtype on a GPU | weights |", "| --- | ---: | --- | ---: |"]
    for name, n in counts.items():
        label = name if name in (TEXT, CLIP, VAE21, VAE22) else f"{name} transformer"
        lines.append(
            f"| {label} | {n / 1e9:.3f} B | {'float32' if name in FLOAT32 else 'bfloat16'} | {size[name]:.2f} GB |"
        )
    lines += [
        "",
        "| model | `--offload none` | `--offload text` | `--offload model` | experts: the other one, kept off |",
    ]
    lines += ["| --- | ---: | ---: | ---: | ---: |"]
    for model, (transformers, clip, vae) in MODELS.items():
        resident = size[transformers[0]]  # with two experts, one on the device (--offload-experts, on with CUDA)
        image = size[clip] if clip else 0.0
        none, text, only = resident + size[TEXT] + image + size[vae], resident + image + size[vae], resident
        other = f"{size[transformers[1]]:.2f} GB" if len(transformers) == 2 else ""
        lines.append(f"| {model} | {none:.2f} GB | {text:.2f} GB | {only:.2f} GB | {other} |")
    return "\n".join(lines)


# -- the phase ------------------------------------------------------------------------------------------------------


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _offloaded_bytes(worker: Any) -> dict[str, int]:
    from distvideo.pipelines.offload import weight_bytes

    offload = worker.pipeline.offload
    return {name: weight_bytes(offload.modules[name]) for name in offload.offloaded}


def measure_mode(model: str | None, mode: str, device: str | None, shape: dict[str, int], steps: int) -> dict[str, Any]:
    """One engine with `--offload mode`, one request: what stays allocated after loading, the request's peak, the
    stage times, and the frames."""
    from distvideo.config import EngineConfig
    from distvideo.generator import VideoGenerator

    _free()
    cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    before = torch.cuda.memory_allocated() if cuda else 0
    config = EngineConfig(model=model, executor="inline", device=device, offload=mode, progress=False)
    began = time.monotonic()
    with VideoGenerator.from_config(config) as gen:
        load_s = time.monotonic() - began
        resident = (torch.cuda.memory_allocated() - before) / 2**20 if cuda else None
        offloaded = gen.collective_rpc(_offloaded_bytes)[0]
        result = gen.generate(
            PROMPT,
            num_frames=shape["num_frames"],
            height=shape["height"],
            width=shape["width"],
            num_inference_steps=steps,
            guidance_scale=5.0,
            seed=0,
            save_video=False,
        )
    _free()
    timings = result.timings
    figures = {
        "load_s": round(load_s, 2),
        "resident_after_load_mb": None if resident is None else round(resident, 1),
        "offloaded_weights_mb": {name: round(n / 2**20, 1) for name, n in offloaded.items()},
        "request_peak_mb": round(result.peak_memory_mb, 1),
        "peak_metric": "cuda max_memory_allocated" if cuda else "peak RSS of the process (not device memory)",
        **{f"{k}_s": round(timings[k], 3) for k in ("text_encoding", "decoding", "total") if k in timings},
    }
    return {"figures": figures, "frames": result.frames}


def offload_phase(
    sizes: Any, large: str | None, guard: Any, progress: Callable[[str], None], *, force: bool = False
) -> dict[str, Any]:
    """Each offload mode on the large checkpoint at the first timed shape, `PHASE_STEPS` steps; the frames of every
    mode must be byte-identical to offload=none. Smoke mode skips it (on the CPU the device is the host memory:
    nothing to save; tests/test_offload.py checks frames and residency there) unless `force` (tests: the code runs)."""
    if sizes.mode == "smoke" and not force:
        return {
            "status": "skipped",
            "reason": "smoke mode: on the CPU offload saves nothing (tests/test_offload.py checks frames and residency)",
        }
    shape = sizes.shapes[0]
    out: dict[str, Any] = {"status": "ok", "shape": f"{shape['num_frames']}x{shape['height']}x{shape['width']}"}
    out.update(steps=PHASE_STEPS, modes={})
    reference = None
    for mode in MODES:
        if reference is not None and guard.left() < 2 * out["modes"]["none"]["load_s"] + 10:
            out["modes"][mode] = {"status": "skipped", "reason": f"{guard.left():.0f} s left in the phase"}
            continue
        measured = measure_mode(large, mode, sizes.device, shape, PHASE_STEPS)
        frames = measured.pop("frames")
        entry = {"status": "ok", **measured["figures"]}
        if reference is None:
            reference = frames
        else:
            same = frames.shape == reference.shape and frames.tobytes() == reference.tobytes()
            entry["frames_vs_none"] = "byte-identical" if same else "differ"
            entry["saving_ok"] = _saving_ok(out["modes"]["none"], entry)
            if not same or entry["saving_ok"] is False:
                entry["status"] = out["status"] = "failed"
        out["modes"][mode] = entry
        progress(f"offload {mode}: peak {entry['request_peak_mb']} MiB, resident {entry['resident_after_load_mb']} MiB")
    return out


def _saving_ok(none: dict[str, Any], entry: dict[str, Any]) -> bool | None:
    """Whether the device memory saved after loading is at least 90% of the offloaded weights (None off CUDA)."""
    if none["resident_after_load_mb"] is None or entry["resident_after_load_mb"] is None:
        return None
    entry["saved_after_load_mb"] = round(none["resident_after_load_mb"] - entry["resident_after_load_mb"], 1)
    return bool(entry["saved_after_load_mb"] >= 0.9 * sum(entry["offloaded_weights_mb"].values()))


def markdown_lines(phase: dict[str, Any]) -> list[str]:
    """The phase's table for gpu_check.md."""
    if phase.get("status") not in ("ok", "failed"):
        return []
    lines = ["", f"## --offload on {phase['shape']}, {phase['steps']} steps, guidance 5", ""]
    lines += [
        "| mode | resident after load (MiB) | saved (MiB) | offloaded weights (MiB) | request peak (MiB) | "
        "text encoding (s) | decoding (s) | frames |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for mode, entry in phase["modes"].items():
        if entry["status"] == "skipped":
            lines.append(f"| {mode} | skipped: {entry['reason']} | | | | | | |")
            continue
        weights = sum(entry["offloaded_weights_mb"].values())
        lines.append(
            f"| {mode} | {entry['resident_after_load_mb']} | {entry.get('saved_after_load_mb', '')} | {weights:.1f} | "
            f"{entry['request_peak_mb']} | {entry.get('text_encoding_s', '')} | {entry.get('decoding_s', '')} | "
            f"{entry.get('frames_vs_none', 'reference')} |"
        )
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", action="store_true", help="print the weight sizes of the offloaded components")
    if parser.parse_args().weights:
        print(weights_table())
    else:
        parser.print_help()

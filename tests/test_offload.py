"""The `offload` engine option (`--offload {none,text,model}`) and `offload_experts`: which components wait in host
memory until their stage, the same frames as without offloading, the bad values refused, and the memory estimate.

The engine runs here with the device ``cpu:0``: tensors stay in host memory (so the frames can be compared byte for
byte), but ``cpu:0`` is not ``cpu`` as a torch.device, so every move of a component names its target and the test
can tell a visit to the device (``module.to(cpu:0)``) from the way back home (``module.to(cpu)``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distvideo import VideoGenerator, envs
from distvideo.cli.main import main
from distvideo.config import OFFLOAD_MODES, EngineConfig
from distvideo.errors import ConfigError
from distvideo.executors import resolve_engine
from distvideo.models.memory import estimate_request
from distvideo.pipelines.offload import HOST, OFFLOADED, ComponentOffload
from distvideo.request import GenerationRequest
from family_checkpoints import family_checkpoint, test_image

REQUEST = {"num_frames": 5, "height": 32, "width": 32, "num_inference_steps": 2, "seed": 3, "save_video": False}
DEVICE = torch.device("cpu", 0)  # a "device" that is host memory, yet distinguishable from HOST


def _generator(model=None, executor="inline", **options) -> VideoGenerator:
    config = EngineConfig(model=None if model is None else str(model), executor=executor, progress=False, **options)
    return VideoGenerator.from_config(config)


def _pipeline(gen: VideoGenerator):
    return gen.collective_rpc(lambda worker: worker.pipeline)[0]  # inline: the rank lives in this process


class StageRecorder:
    """Records where each component is (the offload bookkeeping, and the target of every `.to()`) at each forward of
    a component, so the test sees where everything was while each one computed."""

    def __init__(self, pipeline, names):
        self.pipeline = pipeline
        self.seen: list[tuple[str, dict[str, str]]] = []  # (component computing, placement then)
        self.to_calls: list[tuple[str, torch.device]] = []
        for name in names:
            module = getattr(pipeline, name)
            for label, part in self._computing_parts(name, module):
                part.register_forward_pre_hook(lambda _m, _a, label=label: self._record(label))
            original = module.to

            def spy(*args, name=name, original=original, **kwargs):
                self.to_calls.append((name, torch.device(args[0])))
                return original(*args, **kwargs)

            module.to = spy

    @staticmethod
    def _computing_parts(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
        if name == "vae":  # AutoencoderKLWan.encode/decode are methods; the encoder and decoder are modules
            return [("vae.encode", module.encoder), ("vae.decode", module.decoder)]
        return [(name, module)]

    def _record(self, name: str) -> None:
        self.seen.append((name, dict(self.pipeline.offload.placement)))

    def placements_of(self, name: str) -> list[dict[str, str]]:
        return [placement for computing, placement in self.seen if computing == name]


# -- the helper on its own ------------------------------------------------------------------------------------------


def test_component_offload_moves_only_the_offloaded_and_always_back():
    modules = {"text_encoder": nn.Linear(4, 4), "vae": nn.Linear(4, 4), "image_encoder": None}
    offload = ComponentOffload(modules, DEVICE, "text")
    assert offload.offloaded == ("text_encoder",)
    assert offload.placement == {"text_encoder": "host", "vae": "device"}
    offload.moves.clear()
    with offload.on_device("text_encoder", "vae"):
        assert offload.placement == {"text_encoder": "device", "vae": "device"}
        with offload.on_device("text_encoder"):  # already visiting: stays, and the outer block takes it back
            pass
        assert offload.placement["text_encoder"] == "device"
    assert offload.placement == {"text_encoder": "host", "vae": "device"}
    assert offload.moves == [("text_encoder", "device"), ("text_encoder", "host")]  # the resident VAE never moved
    with pytest.raises(RuntimeError), offload.on_device("text_encoder"):
        raise RuntimeError("a failed stage")
    assert offload.placement["text_encoder"] == "host", "a failing stage must still send the encoder home"


def test_every_mode_places_its_components():
    for mode, expected in OFFLOADED.items():
        names = ("text_encoder", "text_encoder_2", "image_encoder", "vae")  # every family's (HunyuanVideo 1.5's ByT5)
        modules = {name: nn.Linear(2, 2) for name in names}
        offload = ComponentOffload(modules, DEVICE, mode)
        assert {n for n, where in offload.placement.items() if where == "host"} == set(expected), mode
    with pytest.raises(ValueError, match="offload='all'"):
        ComponentOffload({}, DEVICE, "all")


def test_bytes_brought_to_the_device():
    modules = {"text_encoder": nn.Linear(10, 10), "vae": nn.Linear(4, 4, bias=False)}
    assert ComponentOffload(modules, torch.device("cpu"), "model").device_bytes_per_visit() == {}  # host = device
    on_meta = ComponentOffload(modules, torch.device("meta"), "model")  # "meta": never computed, only counted
    assert on_meta.device_bytes_per_visit() == {"text_encoder": 110 * 4, "vae": 16 * 4}
    assert ComponentOffload(modules, torch.device("meta"), "none").device_bytes_per_visit() == {}


# -- the engine: same frames, components where they belong at each stage --------------------------------------------


def test_offload_gives_the_same_frames_and_visits_the_device_per_stage():
    with _generator(device="cpu:0") as gen:
        plain = gen.generate("a fox in the snow", **REQUEST).frames
        assert _pipeline(gen).offload.offloaded == ()
    for mode in ("text", "model"):
        with _generator(device="cpu:0", offload=mode) as gen:
            pipeline = _pipeline(gen)
            recorder = StageRecorder(pipeline, ["text_encoder", "vae"])
            frames = gen.generate("a fox in the snow", **REQUEST).frames
            assert frames.tobytes() == plain.tobytes(), f"offload={mode} changed the frames"
            offloaded = set(OFFLOADED[mode])
            encoding = recorder.placements_of("text_encoder")
            decoding = recorder.placements_of("vae.decode")
            assert encoding and decoding
            assert all(p["text_encoder"] == "device" for p in encoding)
            assert all(p["vae"] == ("host" if "vae" in offloaded else "device") for p in encoding)
            assert all(p["vae"] == "device" and p["text_encoder"] == "host" for p in decoding)
            assert pipeline.offload.placement == {
                "text_encoder": "host",
                "vae": "host" if mode == "model" else "device",
            }
            # every move names its target: the device for the stage, host memory after it
            expected = [("text_encoder", DEVICE), ("text_encoder", HOST)]
            expected += [("vae", DEVICE), ("vae", HOST)] if mode == "model" else []
            assert recorder.to_calls == expected


def test_offload_keeps_the_encoders_and_vae_off_the_device_while_denoising():
    with _generator(device="cpu:0", offload="model") as gen:
        pipeline = _pipeline(gen)
        recorder = StageRecorder(pipeline, ["text_encoder", "vae", "transformer"])
        gen.generate("a fox", **REQUEST)
        denoising = recorder.placements_of("transformer")
        assert len(denoising) == 2 * REQUEST["num_inference_steps"]  # guided: two forwards a step
        assert all(p == {"text_encoder": "host", "vae": "host"} for p in denoising)
        assert recorder.to_calls[0] == ("text_encoder", DEVICE)
        assert not [name for name, _ in recorder.to_calls if name == "transformer"], "the transformer never moves"


@pytest.mark.slow
def test_offload_under_cfg_parallelism_moves_on_every_rank():
    frames, moves = {}, {}
    for mode in ("none", "model"):
        with _generator(executor="mp", num_gpus=2, cfg_parallel=True, offload=mode) as gen:
            frames[mode] = gen.generate("a fox", **REQUEST).frames
            moves[mode] = gen.collective_rpc(lambda worker: worker.pipeline.offload.moves)
    assert frames["model"].tobytes() == frames["none"].tobytes()
    assert moves["none"] == [[("text_encoder", "device"), ("vae", "device")]] * 2  # placed once, never moved
    # each rank encodes its branch's text and joins the decode: both visit, both send them home
    visits = [("text_encoder", "device"), ("text_encoder", "host"), ("vae", "device"), ("vae", "host")]
    assert moves["model"] == [[("text_encoder", "host"), ("vae", "host"), *visits]] * 2


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan21_i2v", "wan22_i2v_a14b", "wan22_ti2v_5b"])
def test_image_to_video_offloads_the_image_encoder_and_the_vae_encode(tmp_path_factory, family):
    model = family_checkpoint(tmp_path_factory, family)
    request = {**REQUEST, "image": str(test_image(tmp_path_factory)), "guidance_scale": 4.0}
    with _generator(model, device="cpu:0") as gen:
        plain = gen.generate("a fox", **request).frames
    with _generator(model, device="cpu:0", offload="model") as gen:
        pipeline = _pipeline(gen)
        clip = ["image_encoder"] if family == "wan21_i2v" else []  # only Wan2.1 I2V has a CLIP image encoder
        assert (pipeline.image_encoder is not None) == bool(clip)
        recorder = StageRecorder(pipeline, ["text_encoder", *clip, "vae"])
        frames = gen.generate("a fox", **request).frames
    assert frames.tobytes() == plain.tobytes()
    home = dict.fromkeys(["text_encoder", *clip, "vae"], "host")
    assert bool(recorder.placements_of("image_encoder")) == bool(clip)
    for placement in recorder.placements_of("image_encoder"):
        assert placement == {**home, "image_encoder": "device"}
    encode, decode = recorder.placements_of("vae.encode"), recorder.placements_of("vae.decode")
    assert encode and decode  # the first frame's latents, then the video
    assert all(p == {**home, "vae": "device"} for p in encode + decode)
    assert [name for name, _ in recorder.to_calls] == ["text_encoder"] * 2 + clip * 2 + ["vae"] * 4


@pytest.mark.slow
def test_offload_experts_is_its_own_switch(tmp_path_factory):
    model = family_checkpoint(tmp_path_factory, "wan22_t2v_a14b")
    with _generator(model, offload="model") as gen:  # on the CPU the experts' default is off, whatever --offload says
        pipeline = _pipeline(gen)
        assert pipeline.residency.offload is False and pipeline.offload.offloaded == ("text_encoder", "vae")
    with _generator(model, offload_experts=True) as gen:
        assert _pipeline(gen).residency.offload is True and _pipeline(gen).offload.offloaded == ()


# -- configuration --------------------------------------------------------------------------------------------------


def test_bad_offload_values_are_config_errors(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=r"offload='all' is not supported; choose one of none, text, model"):
        EngineConfig(offload="all").validate()
    config = tmp_path / "engine.yaml"
    config.write_text("engine:\n  offload: gpu\n")
    assert main(["generate", "--config", str(config), "--prompt", "a fox", "--executor", "inline"]) == 2
    assert "offload='gpu'" in capsys.readouterr().err
    assert main(["generate", "--offload", "all", "--prompt", "a fox"]) == 2  # argparse's choices
    assert "{none,text,model}" in capsys.readouterr().err
    monkeypatch.setenv("DISTVIDEO_OFFLOAD", "everything")
    with pytest.raises(ConfigError, match=r"DISTVIDEO_OFFLOAD='everything'.*none, text, model"):
        EngineConfig().with_defaults()
    assert main(["generate", "--prompt", "a fox", "--executor", "inline", "--output", str(tmp_path / "v.mp4")]) == 2
    assert "DISTVIDEO_OFFLOAD" in capsys.readouterr().err and not (tmp_path / "v.mp4").exists()


def test_offload_defaults_to_the_environment(monkeypatch):
    monkeypatch.delenv("DISTVIDEO_OFFLOAD", raising=False)
    assert EngineConfig().with_defaults().offload == "none"
    monkeypatch.setenv("DISTVIDEO_OFFLOAD", "Model")
    assert EngineConfig().with_defaults().offload == "model"
    assert EngineConfig(offload="text").with_defaults().offload == "text"
    assert EngineConfig().with_defaults().offload_experts is None  # decided by the device when the pipeline is built
    assert tuple(OFFLOADED) == OFFLOAD_MODES
    for mode in OFFLOAD_MODES:
        assert envs.REGISTRY["DISTVIDEO_OFFLOAD"].parse(mode) == mode


def test_offload_flags_in_help(capsys):
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--offload {none,text,model}" in out and "--offload-experts" in out and "--no-offload-experts" in out


# -- the memory estimate --------------------------------------------------------------------------------------------


def test_memory_estimate_adds_what_offload_brings_back():
    info = resolve_engine(EngineConfig(executor="inline")).model
    request = GenerationRequest(prompt="a fox", num_frames=17, height=64, width=64)
    plain = estimate_request(info, request)
    vae, text = 500 * 2**20, 11 * 2**30
    with_vae = estimate_request(info, request, offloaded={"vae": vae})
    assert with_vae.total == max(plain.transformer_bytes, plain.decode_bytes + plain.video_bytes + vae)
    assert with_vae.total > plain.total and "VAE 500 MiB" in with_vae.describe()
    with_text = estimate_request(info, request, offloaded={"text_encoder": text, "vae": vae})
    assert with_text.total == text and with_text.encoder_weight_bytes == text  # the text encoder's visit is the peak
    assert estimate_request(info, request, offloaded={}).total == plain.total

"""`distvideo bench --compare diffusers` on the families: the FLOP count of image conditioning and per-token
timesteps (checked against torch's FlopCounterMode), and a bench run against diffusers' WanImageToVideoPipeline
with two experts, an image and guidance_scale_2."""

from __future__ import annotations

import json

import pytest
import torch

from distvideo.cli.main import main
from distvideo.families.wan.flops import wan_transformer_flops
from family_checkpoints import family_checkpoint, test_image

TEXT_LEN = 7
BASE = dict(num_attention_heads=2, attention_head_dim=6, in_channels=4, out_channels=4, text_dim=6, freq_dim=8,
            ffn_dim=16, num_layers=2)  # fmt: skip


def _counted(model, latents, timestep, **kwargs) -> int:
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_sdpa(query_shape, key_shape, value_shape, *args, **kw):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(hidden_states=torch.randn(latents), timestep=timestep, encoder_hidden_states=torch.randn(1, TEXT_LEN, 6),
              return_dict=False, **kwargs)  # fmt: skip
    return counter.get_total_flops()


def test_flop_count_with_image_tokens_matches_torch():
    from diffusers import WanTransformer3DModel

    config = {**BASE, "in_channels": 8, "image_dim": 10, "added_kv_proj_dim": 12}
    latents = (1, 8, 2, 4, 6)  # noise + condition channels
    counted = _counted(WanTransformer3DModel(**config), latents, torch.tensor([10]),
                       encoder_hidden_states_image=torch.randn(1, 5, 10))  # fmt: skip
    assert counted == wan_transformer_flops(config, latents, TEXT_LEN, image_len=5)
    with pytest.raises(ValueError, match="needs image_len"):
        wan_transformer_flops(config, latents, TEXT_LEN)


def test_flop_count_with_per_token_timesteps_matches_torch():
    from diffusers import WanTransformer3DModel

    latents = (1, 4, 2, 4, 6)
    tokens = 2 * 2 * 3
    counted = _counted(WanTransformer3DModel(**BASE), latents, torch.arange(tokens, dtype=torch.float32)[None])
    assert counted == wan_transformer_flops(BASE, latents, TEXT_LEN, per_token_timesteps=True)
    assert counted > wan_transformer_flops(BASE, latents, TEXT_LEN)


@pytest.mark.slow
def test_bench_against_diffusers_image_to_video_with_two_experts(tmp_path_factory, tmp_path, capsys):
    model = family_checkpoint(tmp_path_factory, "wan22_i2v_a14b")
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(model), "--image", str(test_image(tmp_path_factory)), "--num-frames", "5"]
    args += ["--height", "32", "--width", "48", "--steps", "3", "--guidance-scale-2", "2.0", "--runs", "1"]
    assert main([*args, "--warmup", "0", "--compare", "diffusers", "--json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert report["check"]["frames_max_abs_diff"] <= 2, "the two sides must have made the same video"
    assert report["diffusers"] is not None and report["ratio_e2e"] > 0
    assert report["runs"][0]["diffusers"]["transformer_forwards"] == 6  # 3 steps x 2 branches, both experts counted
    assert not any("forwards" in note for note in report["notes"]), report["notes"]

"""Wan2.2 A14B's experts: which one denoises a step, and the residency that keeps only the active one on the device.

The swap itself moves tensors between a CUDA device and pinned host memory; here (no GPU) it runs with the CPU as
the "device" (offload forced), which checks its bookkeeping: every parameter and buffer changes place, none changes
value, adapters merged into either expert survive any number of swaps, and the frames equal those without offloading
within 2 (not bit for bit: the moved tensors sit at another memory alignment, and MKL's matrix products round
differently on differently aligned inputs; measured: at most 1). The CUDA streams and the peak they save are not
exercised by the test suite (docs/families.md).
"""

from __future__ import annotations

import pytest
import torch

from distvideo import VideoGenerator
from distvideo.lora.rank import transformer_digest
from distvideo.pipelines.experts import ExpertResidency, boundary_timestep, expert_for_step, swap_chunks
from distvideo.testing.lora_files import build_random_lora
from family_checkpoints import family_checkpoint, max_abs_diff

# UniPC with shift 12 at 2 steps: t = 999 (high-noise expert), 923 (low-noise, below 0.95 * 1000)
REQUEST = dict(num_frames=5, height=32, width=32, num_inference_steps=2, boundary_ratio=0.95, guidance_scale=4.0,
               seed=7, save_video=False)  # fmt: skip


@pytest.mark.parametrize(
    ("t", "expected"),
    [(1000.0, "transformer"), (875.0, "transformer"), (874.99, "transformer_2"), (0.0, "transformer_2")],
)
def test_expert_for_step(t, expected):
    boundary = boundary_timestep(0.875, 1000)
    step = expert_for_step(torch.tensor(t), boundary, guidance=4.0, guidance_2=3.0)
    assert step.name == expected
    assert step.guidance_scale == (4.0 if expected == "transformer" else 3.0)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_swap_moves_every_tensor_and_keeps_its_value(tmp_path_factory):
    from diffusers import WanTransformer3DModel

    model = family_checkpoint(tmp_path_factory, "wan22_t2v_a14b")
    experts = {name: WanTransformer3DModel.from_pretrained(model / name) for name in ("transformer", "transformer_2")}
    before = {name: _state(m) for name, m in experts.items()}
    chunks = swap_chunks(experts["transformer"])
    assert len(chunks) == len(experts["transformer"].blocks) + 1
    covered = sum(len(c) for c in chunks)
    assert covered == len(list(experts["transformer"].parameters())) + len(list(experts["transformer"].buffers()))
    residency = ExpertResidency(experts, torch.device("cpu"), offload=True)
    ptr = {name: m.blocks[0].attn1.to_q.weight.data_ptr() for name, m in experts.items()}
    for target in ("transformer_2", "transformer", "transformer_2", "transformer_2"):
        residency.activate(target)
        assert residency.active == target
        for name, module in experts.items():
            after = _state(module)
            assert all(torch.equal(after[k], v) for k, v in before[name].items()), f"{name} changed value"
    assert residency.counts["swaps"] == 3
    assert experts["transformer"].blocks[0].attn1.to_q.weight.data_ptr() != ptr["transformer"], "it moved"


def test_without_offload_on_cpu_nothing_moves(tmp_path_factory):
    from diffusers import WanTransformer3DModel

    model = family_checkpoint(tmp_path_factory, "wan22_t2v_a14b")
    experts = {name: WanTransformer3DModel.from_pretrained(model / name) for name in ("transformer", "transformer_2")}
    ptr = experts["transformer_2"].proj_out.weight.data_ptr()
    residency = ExpertResidency(experts, torch.device("cpu"))
    assert residency.offload is False
    residency.activate("transformer_2")
    assert residency.counts["swaps"] == 0 and experts["transformer_2"].proj_out.weight.data_ptr() == ptr


def _force_offload(worker) -> None:
    pipeline = worker.pipeline
    pipeline.residency = ExpertResidency(pipeline.experts, worker.device, offload=True)


@pytest.mark.slow
def test_offloaded_experts_give_the_same_frames_and_keep_adapters(tmp_path_factory, tmp_path):
    model = family_checkpoint(tmp_path_factory, "wan22_t2v_a14b")
    high = build_random_lora(model, tmp_path / "high.safetensors", seed=1)
    low = build_random_lora(model, tmp_path / "low.safetensors", seed=2)
    with VideoGenerator.from_pretrained(model, executor="inline") as gen:
        plain = gen.generate("a fox", **REQUEST).frames
        gen.set_lora_adapter("high", high, strength=0.7)
        gen.set_lora_adapter("low", low, strength=0.9, target="transformer_2")
        with_lora = gen.generate("a fox", **REQUEST).frames
        gen.clear_lora_adapters()
        base = gen.collective_rpc(transformer_digest)[0]

        gen.collective_rpc(_force_offload)
        runs = [gen.generate("a fox", **REQUEST) for _ in range(2)]  # the second starts on the low-noise expert
        assert all(max_abs_diff(r.frames, plain) <= 2 for r in runs)
        assert runs[0].timings["expert_swap"] >= 0 and "expert_swap" in runs[1].timings
        assert gen.collective_rpc(lambda w: w.pipeline.residency.counts["swaps"])[0] == 3  # high->low, ->high, ->low
        gen.set_lora_adapter("high", strength=0.7)  # merged while "transformer" sits in host memory
        gen.set_lora_adapter("low", strength=0.9, target="transformer_2")
        assert max_abs_diff(gen.generate("a fox", **REQUEST).frames, with_lora) <= 2
        assert max_abs_diff(with_lora, plain) > 20, "the adapters must change the video for this to show anything"
        gen.clear_lora_adapters()
        assert gen.collective_rpc(transformer_digest)[0] == base

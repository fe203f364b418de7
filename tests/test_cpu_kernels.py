"""3D convolutions routed to oneDNN on CPU and the fast channel RMS norms (models/cpu_kernels.py) give PyTorch's and
diffusers' results. The tests marked `onednn` need a torch build with oneDNN, which every x86-64 and aarch64 build of
torch has: there they fail when it is missing; only on a CPU oneDNN does not support are they skipped (conftest.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distvideo import VideoGenerator
from distvideo.models.cpu_kernels import onednn_available, use_cpu_kernels, use_fast_rms_norms, use_onednn_conv3d

from conftest import max_abs_diff


@pytest.fixture
def onednn():
    assert onednn_available(), "this torch build has no oneDNN (every x86-64 and aarch64 build of torch has it)"


@pytest.mark.onednn
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kernel_size=3, padding=0),
        dict(kernel_size=3, padding=1, stride=(1, 2, 2)),
        dict(kernel_size=(1, 2, 2), stride=(1, 2, 2)),
        dict(kernel_size=(3, 1, 1), padding=(1, 0, 0), groups=2),
    ],
)
def test_conv3d_matches_pytorch(kwargs, onednn):
    torch.manual_seed(0)
    conv = nn.Conv3d(4, 6, **kwargs)
    x = torch.randn(1, 4, 3, 11, 9)
    with torch.no_grad():
        ref = conv(x)
        calls = []
        restore = use_onednn_conv3d(conv)
        handle = conv.register_forward_hook(lambda *a: calls.append(1))
        out = conv(x)
        handle.remove()
    assert calls and "_conv_forward" in vars(conv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    restore()
    assert "_conv_forward" not in vars(conv)


@pytest.mark.onednn
def test_wan_causal_conv_uses_onednn(monkeypatch, onednn):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    torch.manual_seed(1)
    conv = WanCausalConv3d(3, 5, 3, padding=1)
    x, cache = torch.randn(1, 3, 1, 8, 8), torch.randn(1, 3, 2, 8, 8)
    with torch.no_grad():
        ref = conv(x, cache)
        use_onednn_conv3d(conv)
        seen = []
        real = torch.ops.aten.mkldnn_convolution

        class Spy:
            def __getattr__(self, name):
                if name == "mkldnn_convolution":
                    return lambda *a: (seen.append(a[0].shape), real(*a))[1]
                return getattr(torch.ops.aten, name)

        monkeypatch.setattr(torch.ops, "aten", Spy())
        out = conv(x, cache)
    assert seen == [torch.Size([1, 3, 3, 10, 10])]  # the causal cache and the row/column padding went in
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channel_first, images", [(True, False), (True, True), (False, True)])
def test_fast_rms_norm_matches_diffusers(dtype, channel_first, images):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    torch.manual_seed(2)
    norm = WanRMS_norm(6, channel_first=channel_first, images=images, bias=True)
    with torch.no_grad():
        norm.gamma.normal_()
        norm.bias.normal_()
    shape = {(True, False): (2, 6, 3, 5, 4), (True, True): (2, 6, 5, 4), (False, True): (2, 5, 4, 6)}
    x = (torch.randn(shape[channel_first, images]) * 3).to(dtype)
    x[0, ..., 0] = 0  # all-zero pixels: the eps clamp, no NaN
    with torch.no_grad():
        ref = norm(x)
        restore = use_fast_rms_norms(norm)
        out = norm(x)
    assert "forward" in vars(norm) and out.dtype == ref.dtype and torch.isfinite(out).all()
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)
    restore()
    assert "forward" not in vars(norm)


@pytest.mark.onednn
def test_autograd_keeps_pytorchs_kernel(onednn):
    conv = nn.Conv3d(2, 2, 3, padding=1)
    use_onednn_conv3d(conv)
    x = torch.randn(1, 2, 2, 5, 5, requires_grad=True)
    conv(x).sum().backward()  # the fallback path: gradients flow as usual
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.onednn
def test_use_cpu_kernels_undoes_both(onednn):
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False])
    restore = use_cpu_kernels(vae)
    assert any("_conv_forward" in vars(m) for m in vae.modules()) and any("forward" in vars(m) for m in vae.modules())
    restore()
    assert not any("_conv_forward" in vars(m) or "forward" in vars(m) for m in vae.modules())


@pytest.mark.onednn
def test_pipeline_frames_equal_with_and_without_cpu_kernels(test_checkpoint, monkeypatch, onednn):
    kwargs = dict(num_frames=9, height=48, width=64, num_inference_steps=2, guidance_scale=3.0, seed=5)
    frames = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("DISTVIDEO_CPU_KERNELS", flag)
        with VideoGenerator.from_pretrained(test_checkpoint, executor="inline") as gen:
            vae = gen.executor.worker.pipeline.vae
            convs = sum("_conv_forward" in vars(m) for m in vae.modules())
            norms = sum("forward" in vars(m) for m in vae.modules() if type(m).__name__ == "WanRMS_norm")
            assert (convs > 0, norms > 0) == ((True, True) if flag == "1" else (False, False))
            frames[flag] = gen.generate("a boat", save_video=False, **kwargs).frames
    assert frames["1"].std() > 1.0
    assert max_abs_diff(frames["0"], frames["1"]) <= 1

"""Device placement per local rank and the dtypes per component: the pure functions behind what a CUDA rank does,
checked with tables on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

from distvideo.config import EngineConfig
from distvideo.devices import component_dtypes, cuda_device_index, select_device
from distvideo.errors import ConfigError
from distvideo.launch import resolve_launch_env

# (case, local rank, GPUs this process sees, CUDA_VISIBLE_DEVICES) -> device index
PLACEMENT = [
    ("torchrun, 4 GPUs, rank 0", 0, 4, None, 0),
    ("torchrun, 4 GPUs, rank 3", 3, 4, None, 3),
    ("srun --gres=gpu:4 without --gpus-per-task, local rank 2", 2, 4, "0,1,2,3", 2),
    ("srun --gpus-per-task=1, local rank 0", 0, 1, "0", 0),
    ("srun --gpus-per-task=1, local rank 3 (its own GPU is cuda:0)", 3, 1, "3", 0),
    ("CUDA_VISIBLE_DEVICES set per rank by hand, local rank 5", 5, 1, "GPU-5f0c", 0),
    ("8 GPUs, 2 ranks, rank 1", 1, 8, None, 1),
]


@pytest.mark.parametrize(("case", "local_rank", "visible", "cvd", "expected"), PLACEMENT, ids=[p[0] for p in PLACEMENT])
def test_cuda_device_index(case, local_rank, visible, cvd, expected):
    assert cuda_device_index(local_rank, visible, cvd) == expected


# more ranks on the node than GPUs, and no GPU at all: refused, with what was seen and what would work
REFUSED = [
    ("torchrun --nproc-per-node 5 on 4 GPUs", 4, 4, None, "4 visible"),
    ("srun --gpus-per-task=2, local rank 2 (sees 2)", 2, 2, "4,5", "'4,5'"),
    ("no GPU visible", 0, 0, "", "none visible"),
]


@pytest.mark.parametrize(("case", "local_rank", "visible", "cvd", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_cuda_device_index_refuses(case, local_rank, visible, cvd, message):
    with pytest.raises(RuntimeError, match="has no GPU") as info:
        cuda_device_index(local_rank, visible, cvd)
    assert message in str(info.value)
    if visible:
        assert "--gpus-per-task=1" in str(info.value) and f"at most {visible} ranks" in str(info.value)


SRUN = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS_PER_NODE": "4"}


@pytest.mark.parametrize(
    ("procid", "localid", "visible", "expected"),
    [
        ("5", "1", 4, 1),  # without --gpus-per-task: every task sees the node's 4 GPUs, SLURM_LOCALID picks one
        ("5", "1", 1, 0),  # --gpus-per-task=1: the task sees only its own GPU
        ("7", "3", 4, 3),
        ("7", "3", 1, 0),
    ],
)
def test_srun_local_rank_selects_device(procid, localid, visible, expected):
    """SLURM_LOCALID becomes the local rank (not SLURM_PROCID), and the local rank picks the device."""
    env = resolve_launch_env({**SRUN, "SLURM_PROCID": procid, "SLURM_LOCALID": localid})
    assert (env.rank, env.local_rank, env.local_world_size) == (int(procid), int(localid), 4)
    assert cuda_device_index(env.local_rank, visible) == expected


def test_select_device_without_gpu():
    assert not torch.cuda.is_available()  # the suite runs on CPU; on a GPU machine this table does not apply
    assert select_device(None, 0) == torch.device("cpu")
    assert select_device(None, 7) == torch.device("cpu")  # any local rank: CPU ranks share the CPU
    assert select_device("cpu", 3) == torch.device("cpu")
    assert select_device("cpu:0", 3) == torch.device("cpu", 0)


@pytest.mark.parametrize("asked", ["cuda", "cuda:1"])
def test_a_cuda_device_on_a_host_without_one_is_a_config_error_naming_device(asked):
    """Not torch's own failure deep in set_device (a ValueError for "cuda", an AttributeError for "cuda:1" on a CPU
    build), but the parameter and what this host has."""
    with pytest.raises(ConfigError, match=rf"device='{asked}': torch sees no CUDA GPU on host"):
        select_device(asked, 0)


@pytest.mark.parametrize("device", ["banana", "cuda:x", "cuda:", ":0", "CPU"])
def test_a_device_that_is_not_one_is_refused_by_the_config(device):
    with pytest.raises(ConfigError, match=rf"device={device!r} is not a device"):
        EngineConfig(device=device).validate()


@pytest.mark.parametrize("device", ["cpu", "cpu:0", "cuda", "cuda:7", "meta", "xpu:1"])
def test_the_config_takes_every_device_torch_names(device):
    EngineConfig(device=device).validate()
    assert torch.device(device).type == device.partition(":")[0]


BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16
DTYPES = [
    ("cuda", None, {"transformer": BF16, "transformer_2": BF16, "text_encoder": BF16, "vae": F32, "image_encoder": F32}),
    ("cpu", None, {"transformer": F32, "transformer_2": F32, "text_encoder": F32, "vae": F32, "image_encoder": F32}),
    ("cuda", "float32", {"transformer": F32, "transformer_2": F32, "text_encoder": F32, "vae": F32, "image_encoder": F32}),
    ("cpu", "bfloat16", {"transformer": BF16, "transformer_2": BF16, "text_encoder": BF16, "vae": F32, "image_encoder": F32}),
    ("cuda", "float16", {"transformer": F16, "transformer_2": F16, "text_encoder": F16, "vae": F32, "image_encoder": F32}),
]  # fmt: skip


@pytest.mark.parametrize(("device", "dtype", "expected"), DTYPES)
def test_component_dtypes(device, dtype, expected):
    """bfloat16 on CUDA except the VAE and the CLIP image encoder, which stay float32 as diffusers keeps them."""
    assert component_dtypes(torch.device(device), dtype) == expected

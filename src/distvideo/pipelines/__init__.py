"""Pipelines: a request dataclass flowing through explicit stages; one class per model family (its registry entry's
`pipeline` key)."""

from distvideo.pipelines.hunyuan15 import HunyuanVideo15T2VPipeline
from distvideo.pipelines.hunyuan15_i2v import HunyuanVideo15I2VPipeline
from distvideo.pipelines.wan import WanT2VPipeline
from distvideo.pipelines.wan22_a14b import Wan22I2VA14BPipeline, Wan22T2VA14BPipeline
from distvideo.pipelines.wan22_ti2v import Wan22TI2VPipeline
from distvideo.pipelines.wan_i2v import WanI2VPipeline

PIPELINES = {
    "wan_t2v": WanT2VPipeline,
    "wan_i2v": WanI2VPipeline,
    "wan22_t2v_a14b": Wan22T2VA14BPipeline,
    "wan22_i2v_a14b": Wan22I2VA14BPipeline,
    "wan22_ti2v_5b": Wan22TI2VPipeline,
    "hunyuan15_t2v": HunyuanVideo15T2VPipeline,
    "hunyuan15_i2v": HunyuanVideo15I2VPipeline,
}

__all__ = [
    "PIPELINES",
    "HunyuanVideo15I2VPipeline",
    "HunyuanVideo15T2VPipeline",
    "Wan22I2VA14BPipeline",
    "Wan22T2VA14BPipeline",
    "Wan22TI2VPipeline",
    "WanI2VPipeline",
    "WanT2VPipeline",
]

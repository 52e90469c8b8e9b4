"""Qwen2.5-VL: Qwen2-VL with a windowed-attention vision tower and time-scaled video positions.

Everything but the tower class and the temporal position step is Qwen2-VL's: a video's frame
groups are ``tokens_per_second * second_per_grid_ts`` positions apart (floored), as in
transformers' ``get_rope_index``; images keep a step of 1.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)

from model_zoo.qwen2_vl import Qwen2VLForConditionalGeneration
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from processors.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2VLMultiModalProcessor,
    info=Qwen2VLProcessingInfo,
    dummy_inputs=Qwen2VLDummyInputsBuilder,
)
class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower_cls: ClassVar[type[nn.Module]] = Qwen2_5_VisionTransformerPretrainedModel

    def time_interval(self, feature: MultiModalFeatureSpec) -> Any:
        if feature.modality != "video":
            return 1
        tokens_per_second = self.config.vision_config.tokens_per_second
        seconds = (feature.data or {}).get("second_per_grid_ts")
        if seconds is None:
            return tokens_per_second  # transformers' default of 1 s per grid
        # float32, as the HF processor returns it, so the floored positions match exactly
        return tokens_per_second * torch.as_tensor(seconds, dtype=torch.float32).reshape(())

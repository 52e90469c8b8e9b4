"""``*ForSequenceClassification`` (transformers' classes): a text family's decoder with a
``score`` head of ``num_labels`` rows in place of the LM head. The engine pools the prompt's
final states (at its last position, as transformers does, unless ``--pooler-config`` says
otherwise) and classifies the pooled state with the head: ``LLM.classify``, ``/classify``, and
with one label cross-encoder scoring (``/score``, ``/rerank``)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from model_zoo.decoder import DecoderForCausalLM
from model_zoo.llama import LlamaForCausalLM
from model_zoo.qwen2 import Qwen2ForCausalLM
from model_zoo.qwen3 import Qwen3ForCausalLM
from omniserve.layers.weight_utils import WeightRoute


class SequenceClassifier(DecoderForCausalLM):
    """The family's decoder and a ``score`` head; its "logits" are the labels' scores."""

    is_classifier: ClassVar[bool] = True

    def __init__(self, config: PretrainedConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.init_language_model(type(self), config, tie_word_embeddings=False, lm_head=False)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.score(hidden_states).float()  # [num_tokens, num_labels]

    def route_weight(self, name: str) -> WeightRoute | None:
        if name == "lm_head.weight":
            return None  # a causal LM's head, when the checkpoint still has one
        return super().route_weight(name)


class Qwen2ForSequenceClassification(SequenceClassifier, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassifier, Qwen3ForCausalLM):
    pass


class LlamaForSequenceClassification(SequenceClassifier, LlamaForCausalLM):
    pass

"""``*ForSequenceClassification`` (transformers' classes): a text family's decoder with a
``score`` head of ``num_labels`` rows in place of the LM head. The engine pools the prompt's
final states (at its last position, as transformers does, unless ``--pooler-config`` says
otherwise) and classifies the pooled state with the head: ``LLM.classify``, ``/classify``, and
with one label cross-encoder scoring (``/score``, ``/rerank``).

A causal LM checkpoint loads as one with vLLM's ``classifier_from_token`` (through
``--hf-overrides``): the head is made of its LM head's rows of those tokens, their difference
for the 2-way softmax of an LLM reranker (Qwen3-Reranker's "no" / "yes": the score's sigmoid is
the probability of "yes"), else one label per token (``ModelConfig.hf_config`` resolves the
tokens' ids and the number of labels)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from model_zoo.decoder import DecoderForCausalLM
from model_zoo.llama import LlamaForCausalLM
from model_zoo.qwen2 import Qwen2ForCausalLM
from model_zoo.qwen3 import Qwen3ForCausalLM
from omniserve.layers.weight_utils import LoadedWeight, WeightRoute


class SequenceClassifier(DecoderForCausalLM):
    """The family's decoder and a ``score`` head; its "logits" are the labels' scores."""

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

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        token_ids = getattr(self.config, "classifier_token_ids", None)
        if token_ids is None:
            return super().load_weights(weights)
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        rows: list[torch.Tensor] = []

        def keep_rows(named: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, Any]]:
            for name, tensor in named:
                if name == head:
                    # In the head's dtype before any difference (fp32 from bf16 is exact).
                    dtype = self.score.weight.dtype
                    rows.extend(tensor.narrow(0, i, 1)[0].to(dtype) for i in token_ids)
                yield name, tensor

        loaded = super().load_weights(keep_rows(weights))
        if not rows:
            raise ValueError(f"classifier_from_token: the checkpoint has no {head}.")
        if self.config.method == "from_2_way_softmax":
            rows = [rows[1] - rows[0]]
        self.score.weight.copy_(torch.stack(rows))
        return loaded | {"score.weight"}


class Qwen2ForSequenceClassification(SequenceClassifier, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassifier, Qwen3ForCausalLM):
    pass


class LlamaForSequenceClassification(SequenceClassifier, LlamaForCausalLM):
    pass

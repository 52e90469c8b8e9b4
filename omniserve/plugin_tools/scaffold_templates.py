"""The files ``omniserve register-model --scaffold`` writes, as ``string.Template`` texts.

Placeholders: ``$name`` (the package), ``$architecture`` (the plugin's), ``$base_arch`` (the
built-in it starts from), ``$prefix`` (CamelCase of the package, for class names) and the
import lines computed by ``scaffold.py``. The generated code is ruff-clean at line length 100.
"""

from __future__ import annotations

from string import Template

PYPROJECT = Template("""\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist_name"
version = "0.1.0"
description = "$architecture: an omniserve model plugin, starting from $base_arch."
requires-python = ">=3.11"
dependencies = ["omniserve"]

# omniserve calls every function of this group in each process that builds a model.
[project.entry-points."omniserve.plugins"]
$name = "$name:register"

[tool.setuptools.packages.find]
include = ["$name*"]

[tool.pytest.ini_options]
pythonpath = ["."]

[tool.ruff]
line-length = 100

[tool.ruff.lint]
select = ["E", "F", "W", "I", "UP", "B"]
""")

README = Template("""\
# $name

`$architecture`, an omniserve model plugin that starts as the built-in `$base_arch`:
same modules, same checkpoint parameter names. Edit `$name/model.py` (and `$name/processor.py`
for a multimodal model), then validate and serve it:

```bash
pip install -e .                        # installs the "omniserve.plugins" entry point
python -m pytest                        # runs `register-model --check` on a tiny checkpoint
omniserve register-model $architecture --check "$$(omniserve make-tiny $base_arch)"
omniserve make-tiny $base_arch --as-architecture $architecture --out tiny-$name
omniserve serve tiny-$name              # config.json "architectures" picks the plugin
```

Without installing, record the classes in your registry file instead:
`omniserve register-model $architecture --model $name.model:$architecture --path .`
""")

INIT = Template('''\
"""An omniserve model plugin.

It registers ``ARCHITECTURE``, which starts as the built-in ``BASE_ARCHITECTURE``. omniserve
calls ``register`` (the "omniserve.plugins" entry point in pyproject.toml) in every process that
builds a model, the engine process included. It records a class path only, so loading the
plugin stays cheap; the model module is imported once a checkpoint whose config.json
"architectures" names ``ARCHITECTURE`` is loaded.
"""

from __future__ import annotations

ARCHITECTURE = "$architecture"
BASE_ARCHITECTURE = "$base_arch"


def register() -> None:
    from omniserve.registry import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, f"{__name__}.model:{ARCHITECTURE}")
''')

MODEL_MULTIMODAL = Template('''\
"""The plugin's model; it starts as the built-in $base_arch.

The engine calls these hooks; each override below starts as the built-in behaviour:

- ``get_multimodal_embeddings(modality, items)``: one ``[num_embeds, hidden_size]`` tensor per
  item, where ``num_embeds`` equals the embedding tokens the processor put in the item's
  placeholder range (``omniserve register-model --check`` compares the two);
- ``forward(input_ids, positions, inputs_embeds)``: the decoder, ``[num_tokens, hidden_size]``;
- ``load_weights(weights)``: place every checkpoint tensor and return the loaded parameter names
  (unknown keys must raise; parameters nothing filled are reported by the loader).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
$model_imports
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY

from $name.processor import (
    ${prefix}DummyInputsBuilder,
    ${prefix}MultiModalProcessor,
    ${prefix}ProcessingInfo,
)


@MULTIMODAL_REGISTRY.register_processor(
    ${prefix}MultiModalProcessor,
    info=${prefix}ProcessingInfo,
    dummy_inputs=${prefix}DummyInputsBuilder,
)
class $architecture($base_class):
    """Runs the checkpoints whose config.json "architectures" names this class."""

    def get_multimodal_embeddings(
        self, modality: str, items: list[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        return super().get_multimodal_embeddings(modality, items)

$common_methods''')

MODEL_TEXT = Template('''\
"""The plugin's model; it starts as the built-in $base_arch.

The engine calls these hooks; each override below starts as the built-in behaviour:

- ``forward(input_ids, positions, inputs_embeds)``: the decoder, ``[num_tokens, hidden_size]``;
- ``load_weights(weights)``: place every checkpoint tensor and return the loaded parameter names
  (unknown keys must raise; parameters nothing filled are reported by the loader).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
$model_imports


class $architecture($base_class):
    """Runs the checkpoints whose config.json "architectures" names this class."""

$common_methods''')

COMMON_METHODS = """\
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return super().forward(input_ids, positions, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(weights)
"""

PROCESSOR = Template('''\
"""The plugin's multimodal processing: three classes, each starting as the built-in one.

- the processing info: the modalities with their items-per-prompt limits, and an upper bound on
  one item's tokens (sizes the engine's encoder budget at start-up);
- the dummy-inputs builder: the worst-case prompt and items for the start-up profile run;
- the processor: how the Hugging Face processor's outputs are cut into items
  (``_get_mm_fields_config``) and how each item's placeholder expands into exactly as many
  tokens as the model's encoder returns embeddings (``_get_prompt_updates``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

$processor_imports


class ${prefix}ProcessingInfo($info_base):
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return super().get_supported_mm_limits()

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        return super().get_mm_max_tokens_per_item(seq_len, mm_counts)


class ${prefix}DummyInputsBuilder($dummy_base):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return super().get_dummy_text(mm_counts)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]) -> dict[str, Any]:
        return super().get_dummy_mm_data(seq_len, mm_counts)


class ${prefix}MultiModalProcessor($processor_base):
    # Its companions, for `omniserve register-model ... --processor <this class>`.
    info_cls: ClassVar[type] = ${prefix}ProcessingInfo
    dummy_inputs_cls: ClassVar[type] = ${prefix}DummyInputsBuilder

    def _get_mm_fields_config(
        self, hf_inputs: Mapping[str, Any], hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs)

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_items: Mapping[str, list[dict[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        return super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_items)
''')

TEST = Template('''\
"""The plugin passes omniserve's own validation (`omniserve register-model --check`) on a tiny
checkpoint of the architecture it starts from, built offline."""

from __future__ import annotations

from pathlib import Path

from omniserve.checkpoint_builder import build_tiny_checkpoint
from omniserve.plugin_tools.check import check_plugin

from $name import ARCHITECTURE, BASE_ARCHITECTURE

PROJECT_DIR = Path(__file__).resolve().parents[1]


def test_plugin_passes_the_check(tmp_path, monkeypatch):
    # A private registry dir: the check never touches the user's registered models.
    monkeypatch.setenv("OMNISERVE_CONFIG_DIR", str(tmp_path))
    checkpoint = build_tiny_checkpoint(BASE_ARCHITECTURE)
    report = check_plugin(
        ARCHITECTURE,
        checkpoint,
        model=f"$name.model:{ARCHITECTURE}",
        path=str(PROJECT_DIR),
    )
    assert report.passed, report.table()
''')

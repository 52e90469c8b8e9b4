"""Suite-wide setup: Hugging Face offline, a reusable tiny-checkpoint cache, the `gpu` marker."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# NOTE: set before anything imports huggingface_hub, which reads these once at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Checkpoints are keyed by their inputs, so reruns (and CI caches of .pytest_cache) reuse them.
os.environ.setdefault(
    "OMNISERVE_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "omniserve")
)
# The suite's processes (two pytest workers, servers, engine cores, workers) share two cores:
# OpenMP threads that spin while they wait (GNU OpenMP's default) burn the cores the others need.
# Measured over the whole suite on 2 cores: 28 min of CPU in 15:52 spinning, 15 min in 9:09
# sleeping. Each process also computes on one thread: two workers already keep both cores busy,
# and a second thread per process only oversubscribes them (14 min in 8:23 with one). Set here,
# before anything loads OpenMP; every process the suite starts inherits both. The kernels' own
# tests run theirs on two threads (``kernel_threads``), so their threaded paths stay covered.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Offline engines (``LLM``) run their core in the test's process: a core process of its own costs
# each of the suite's hundreds of engines ~4 s of start-up (a Python with torch and transformers).
# The process path keeps its own tests (test_engine_core_proc and the ones that set this to 1),
# and every server the suite starts runs its engine in a process of its own, as always.
os.environ.setdefault("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
# The user's model registry file must never leak into (or be written by) the suite.
os.environ["OMNISERVE_CONFIG_DIR"] = tempfile.mkdtemp(prefix="omniserve-test-config-")


RULES_FIRST = ("tests/test_code_rules.py", "tests/test_layering.py")
"""The code rules (lint, format, types, layering, size) run first: they fail in seconds."""


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in RULES_FIRST)  # stable
    _group_by_module(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # keep torch-free test runs free of the torch import
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


def _group_by_module(items: list[pytest.Item]) -> None:
    """A module whose tests share a module-scoped fixture (a server, an engine, a reference run)
    runs on one xdist worker (``--dist loadgroup``, in pyproject's addopts), all of its tests in
    file order: spread over both workers, each would set the fixture up, and a test that reads
    what the module's earlier tests recorded (the fuzzing's tally) would see none of it."""
    shared = set()
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d.scope == "module" for chain in defs for d in chain):
            shared.add(item.nodeid.split("::")[0])
    for item in items:
        module = item.nodeid.split("::")[0]
        if module in shared:
            item.add_marker(pytest.mark.xdist_group(module))


@pytest.fixture
def kernel_threads() -> Iterator[None]:
    """The test on two torch threads (the suite's processes default to one): the CPU kernels
    split their work over ``torch.get_num_threads()`` threads."""
    from omniserve.engine.processor import torch_threads

    with torch_threads(2):
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Callable[..., Path]:
    """Factory `tiny_checkpoint(arch, size=..., seed=..., overrides=...) -> Path`, memoized."""
    from omniserve.checkpoint_builder import build_tiny_checkpoint

    built: dict[str, Path] = {}

    def build(architecture: str, **kwargs: Any) -> Path:
        key = json.dumps([architecture, kwargs], sort_keys=True, default=repr)
        if key not in built:
            built[key] = build_tiny_checkpoint(architecture, **kwargs)
        return built[key]

    return build


@pytest.fixture(scope="session")
def thinking_model(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The tiny Qwen3 checkpoint with ``<think>`` and ``</think>`` as tokens of its own (ids
    inside the embedding's padded vocabulary), as Qwen3's tokenizer has them."""
    import shutil

    from transformers import AutoTokenizer

    base = tiny_checkpoint("Qwen3ForCausalLM")
    target = tmp_path_factory.mktemp("thinking")
    for item in base.iterdir():
        if item.suffix == ".safetensors":
            (target / item.name).symlink_to(item)
        elif item.is_file():
            shutil.copy(item, target / item.name)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    tokenizer.save_pretrained(str(target))
    return str(target)


@pytest.fixture(scope="session")
def bf16_checkpoint(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], str]:
    """Factory ``bf16_checkpoint(arch)``: the tiny checkpoint with every floating-point tensor
    and the config's dtype in bf16, memoized."""
    import shutil

    from safetensors.torch import load_file, save_file

    made: dict[str, str] = {}

    def make(architecture: str) -> str:
        if architecture not in made:
            target = tmp_path_factory.mktemp(f"{architecture}-bf16")
            shutil.copytree(tiny_checkpoint(architecture), target, dirs_exist_ok=True)
            for path in target.glob("*.safetensors"):
                tensors = {k: v.bfloat16() if v.is_floating_point() else v
                           for k, v in load_file(path).items()}  # fmt: skip
                save_file(tensors, path, metadata={"format": "pt"})
            config = json.loads((target / "config.json").read_text())
            config["dtype"] = "bfloat16"
            (target / "config.json").write_text(json.dumps(config))
            made[architecture] = str(target)
        return made[architecture]

    return make


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`omniserve serve` with no model (the built-in tiny omni thinker), started once for the
    modules that drive it: fp32 (exact against offline runs), a 16 MiB processor cache (the soak
    keeps it evicting)."""
    from tests.server_utils import launch_server

    with launch_server(
        None,
        tmp_path_factory.mktemp("default"),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "16MiB",
        "--mm-processor-cache-gb",
        "0.015625",
    ) as server:
        yield server


@pytest.fixture(scope="session")
def qwen3_server(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Any:
    """A tiny Qwen3 (its template has tools and the thinking switch) served as agents use it:
    ``--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes``, trusting
    request chat templates; shared by the structured-output, reasoning and tool-call modules."""
    from tests.server_utils import launch_server

    with launch_server(
        tiny_checkpoint("Qwen3ForCausalLM"),
        tmp_path_factory.mktemp("qwen3"),
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "32MiB",
        "--reasoning-parser",
        "qwen3",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--trust-request-chat-template",
    ) as server:
        yield server

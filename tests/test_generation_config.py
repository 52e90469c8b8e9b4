"""``--generation-config``: the checkpoint's recommended sampling settings fill in the fields a
request omits (as vLLM does), ``vllm`` turns them off, and a directory brings its own."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from omniserve import LLM, SamplingParams
from omniserve.config import ModelConfig
from omniserve.engine.arg_utils import EngineArgs
from tests.server_utils import API_KEY, MODEL, Server, launch_server

pytestmark = pytest.mark.slow  # servers with and without the checkpoint defaults

RECOMMENDED = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 5,
    "do_sample": True,
    "eos_token_id": [2002, 2000],
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 with a generation_config.json that recommends sampling settings."""
    path = tmp_path_factory.mktemp("recommended") / "model"
    shutil.copytree(tiny_checkpoint("Qwen3ForCausalLM"), path)
    (path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return path


def test_defaults_come_from_the_checkpoint_unless_turned_off(
    checkpoint: Path, tmp_path: Path
) -> None:
    expected = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 5,
    }
    assert ModelConfig.from_path(str(checkpoint)).default_sampling_params() == expected
    assert (
        ModelConfig.from_path(str(checkpoint), generation_config="vllm").default_sampling_params()
        == {}
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.1}))
    assert ModelConfig.from_path(
        str(checkpoint), generation_config=str(tmp_path)
    ).default_sampling_params() == {"temperature": 0.1}
    with pytest.raises(ValueError, match="no generation_config.json there"):
        ModelConfig.from_path(str(checkpoint), generation_config=str(tmp_path / "nowhere"))


def test_overrides_set_over_the_file_or_alone(checkpoint: Path) -> None:
    """vLLM's --override-generation-config: merged over the file's settings ("auto" or a
    directory), the only defaults under "vllm"; unknown keys and unusable values fail at start."""
    override = {"temperature": 0.2, "max_new_tokens": 9}
    merged = ModelConfig.from_path(str(checkpoint), override_generation_config=override)
    assert merged.default_sampling_params() == {
        "temperature": 0.2, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 9
    }  # fmt: skip
    alone = ModelConfig.from_path(
        str(checkpoint), generation_config="vllm", override_generation_config=override
    )
    assert alone.default_sampling_params() == {"temperature": 0.2, "max_tokens": 9}
    with pytest.raises(ValueError, match=r"\['do_sample'\] are not among the settings"):
        ModelConfig.from_path(str(checkpoint), override_generation_config={"do_sample": True})
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flag, message in (('{"top_p": 7}', "top_p"), ("[1]", "must be a JSON object"),
                          ("{temperature", "must be JSON")):  # fmt: skip
        flags = parser.parse_args(["--override-generation-config", flag])
        engine_args = EngineArgs(
            str(checkpoint), override_generation_config=flags.override_generation_config
        )
        with pytest.raises(ValueError, match=message) as error:
            engine_args.create_config()
        assert "--override-generation-config" in str(error.value)


def test_offline_defaults(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(checkpoint), max_model_len=256, kv_cache_memory="16MiB")
    try:
        params = llm.get_default_sampling_params()
        assert (
            params.temperature,
            params.top_p,
            params.top_k,
            params.repetition_penalty,
            params.max_tokens,
        ) == (0.6, 0.95, 20, 1.05, 5)
        out = llm.generate("Hello", use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) <= 5
        explicit = llm.generate(
            "Hello", SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False
        )[0].outputs[0]
        assert len(explicit.token_ids) == 7
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch_server(
        checkpoint,
        tmp_path_factory.mktemp("genconfig"),
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
    ) as running:
        yield running


def test_server_applies_and_shows_the_defaults(server: Server) -> None:
    card = httpx.get(
        server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()["data"][0]
    assert card["default_sampling_params"]["temperature"] == 0.6
    assert (
        "Default sampling parameters from the checkpoint's generation config"
        in server.log.read_text()
    )
    client = server.client()
    # max_new_tokens 5 caps an omitted max_tokens; a request's own values win.
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 5
    longer = client.chat.completions.create(
        model=MODEL,
        max_tokens=9,
        temperature=0.0,
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"ignore_eos": True},
    )
    assert longer.usage.completion_tokens == 9
    # The recommended temperature is in force: seeded sampling differs from greedy.
    greedy = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True}
    )
    sampled = {
        client.completions.create(
            model=MODEL, prompt="Once", max_tokens=5, seed=seed, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for seed in range(6)
    }
    assert sampled != {greedy.choices[0].text}


def test_completions_default_to_16_tokens_as_openai(server: Server) -> None:
    """OpenAI's and vLLM's completions API default max_tokens is 16 (the checkpoint's
    max_new_tokens only applies when the request leaves it null)."""
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt="Once", temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 16

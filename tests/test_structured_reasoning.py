"""Structured outputs under ``--reasoning-parser`` (vLLM's): the grammar constrains the answer
after ``<think>…</think>``, not the thinking. On the tiny Qwen3 checkpoint with the two tags as
tokens, greedy fp32: a prompt that leaves the thinking open thinks freely (a thinking budget
closes it), then answers under the grammar; an answer may open its thinking with its first
token; ``enable_in_reasoning`` and a tokenizer without the tags keep the grammar from the first
token; ``--structured-outputs-config`` is checked and applied."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from omniserve import LLM, SamplingParams
from omniserve.config import ModelConfig
from omniserve.config.structured_outputs import StructuredOutputsConfig
from omniserve.engine.arg_utils import EngineArgs, json_arg
from omniserve.sampling_params import StructuredOutputsParams
from omniserve.structured_output import StructuredOutputManager, allowed_by_bitmask
from omniserve.tokenizer import get_tokenizer
from tests.hf_reference import make_prompts

REGEX = "[ab]{4}"


def _params(budget: int | None = None, regex: str | None = REGEX, **more) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, thinking_token_budget=budget,
                          structured_outputs={"regex": regex} if regex else None,
                          **more)  # fmt: skip


def _answer(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return list(output.outputs[0].token_ids)


@pytest.fixture(scope="module")
def reasoning_llm(thinking_model):
    llm = LLM(thinking_model, dtype="float32", max_model_len=128, reasoning_parser="qwen3")
    yield llm
    llm.llm_engine.shutdown()


def test_thinking_is_free_then_the_answer_follows_the_grammar(
    reasoning_llm, thinking_model
) -> None:
    llm = reasoning_llm
    tokenizer = llm.get_tokenizer()
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = make_prompts(thinking_model, [12])[0] + [start]
    free = _answer(llm, prompt, _params(regex=None))
    got = _answer(llm, prompt, _params(budget=3))
    assert got[:3] == free[:3] and got[3] == end  # thought freely, closed by the budget
    answer = tokenizer.decode(got[4:], skip_special_tokens=True)
    assert re.fullmatch(REGEX, answer), answer
    # The same prompt and grammar on an engine whose grammars include the thinking.
    whole = LLM(thinking_model, dtype="float32", max_model_len=128,
                structured_outputs_config={"enable_in_reasoning": True},
                reasoning_parser="qwen3")  # fmt: skip
    text = whole.get_tokenizer().decode(_answer(whole, prompt, _params()),
                                        skip_special_tokens=True)  # fmt: skip
    assert re.fullmatch(REGEX, text), text
    whole.llm_engine.shutdown()


def test_an_answer_opening_its_thinking_keeps_the_grammar_for_after(
    reasoning_llm, thinking_model
) -> None:
    """A prompt that leaves no thinking open: the first token may be the start tag beside the
    grammar's first tokens (this model's greedy pick), then the thinking is free; kept off it
    (``logit_bias``), the answer follows the grammar from its first token."""
    llm = reasoning_llm
    tokenizer = llm.get_tokenizer()
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = make_prompts(thinking_model, [10])[0]
    opened = _answer(llm, prompt, _params(budget=2))
    assert opened[0] == start and opened[3] == end
    assert re.fullmatch(REGEX, tokenizer.decode(opened[4:], skip_special_tokens=True))
    plain = _answer(llm, prompt, _params(logit_bias={start: -100}))
    assert re.fullmatch(REGEX, tokenizer.decode(plain, skip_special_tokens=True))


def test_manager_gates_the_grammar_on_the_thinking(thinking_model) -> None:
    tokenizer = get_tokenizer(thinking_model)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    manager = StructuredOutputManager(ModelConfig.from_path(thinking_model))
    compiled = manager.compile_async(StructuredOutputsParams(regex="a+")).result()
    vocab = manager.vocab_size
    a = tokenizer.encode("a", add_special_tokens=False)[0]

    def allowed(req: str) -> np.ndarray | None:
        row = manager.bitmask_row(req)
        return None if row is None else allowed_by_bitmask([row], vocab)[0]

    manager.start("open", compiled, (start, end), [5, 6, start])
    assert allowed("open") is None  # thinking: free
    manager.accept("open", [7, 8])
    assert allowed("open") is None
    manager.accept("open", [end])
    row = allowed("open")
    assert row is not None and row[a] and not row[start] and not row[end]
    manager.accept("open", [a])
    # Not open (no tag, or the prompt closed it): the first token may open it, once.
    for prompt in ([5, 6], [start, 7, end]):
        manager.start("may", compiled, (start, end), prompt)
        row = allowed("may")
        assert row is not None and row[a] and row[start] and not row[end]
        manager.accept("may", [a])
        row = allowed("may")
        assert row is not None and not row[start]
        manager.remove("may")
    manager.start("may", compiled, (start, end), [5])
    manager.accept("may", [start, 9, end, a])  # opened, thought, closed, answered in one go
    assert not allowed("may")[start]  # type: ignore[index]
    with pytest.raises(RuntimeError, match="forbids"):
        manager.accept("may", [start])
    manager.start("plain", compiled)  # no reasoning parser: the grammar from the start
    assert not allowed("plain")[start]  # type: ignore[index]


def test_without_the_tags_the_grammar_applies_from_the_start(tiny_checkpoint, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(tiny_checkpoint("Qwen3ForCausalLM")), dtype="float32", max_model_len=64,
                  reasoning_parser="deepseek_r1")  # fmt: skip
        text = llm.generate({"prompt_token_ids": [1, 2, 3]}, _params(), use_tqdm=False)[0]
    assert re.fullmatch(REGEX, text.outputs[0].text)
    assert "has no <think> and </think> tokens" in caplog.text
    llm.llm_engine.shutdown()


def test_structured_outputs_config() -> None:
    def parse(value: object, reasoning_parser: str | None = None) -> StructuredOutputsConfig:
        """As ``EngineArgs`` reads the flag: JSON text or a dict."""
        options = json_arg("structured_outputs_config", value)  # type: ignore[arg-type]
        return StructuredOutputsConfig.from_dict(options, reasoning_parser)

    assert parse(None) == StructuredOutputsConfig()
    assert parse('{"backend": "xgrammar"}', "qwen3").thinking_tags == ("<think>", "</think>")
    assert parse({"reasoning_parser": "qwen3", "enable_in_reasoning": True}).thinking_tags is None
    assert parse({"disable_any_whitespace": True}).disable_any_whitespace
    for value, why in (
        ({"backend": "guidance"}, "'guidance' is not available"),
        ({"backend": "fast"}, "backend must be one of"),
        ({"grammar": 1}, r"unknown key\(s\) \['grammar'\]"),
        ({"reasoning_parser": "r2"}, "reasoning_parser must be one of"),
        ({"disable_fallback": "yes"}, "disable_fallback must be true or false"),
        ({"enable_in_reasoning": 1}, "enable_in_reasoning must be true or false"),
        ("{", "--structured-outputs-config must be JSON"),
        ("[1]", "--structured-outputs-config must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=why):
            parse(value)
    with pytest.raises(ValueError, match="contradicts"):
        parse({"reasoning_parser": "qwen3"}, "deepseek_r1")


def test_config_reaches_the_requests(thinking_model, caplog) -> None:
    """Flags (``EngineArgs.from_cli_args``) -> config -> each request's constraint."""
    import argparse

    from omniserve.engine.processor import Processor

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--reasoning-parser", "qwen3", "--structured-outputs-config",
         '{"disable_any_whitespace": true, "disable_fallback": true}']
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        config = EngineArgs.from_cli_args(argparse.Namespace(model=thinking_model, **vars(args)))
        config = config.create_config()
    assert "disable_fallback has no effect here" in caplog.text
    processor = Processor(config)
    processed = processor.process_inputs("r", {"prompt_token_ids": [1, 2]}, _params())
    constraint = processed.engine_requests[0].sampling_params.structured_outputs
    assert constraint is not None and constraint.disable_any_whitespace
    start, end = processor.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert constraint.after_thinking == (start, end)


@pytest.fixture
def plugin_parsers():
    """Forgets the parsers a test's plugin file registers."""
    from omniserve.config.structured_outputs import REASONING_TAGS
    from omniserve.entrypoints.openai.reasoning import REASONING_PARSERS

    before = set(REASONING_TAGS)
    yield
    for name in set(REASONING_TAGS) - before:
        del REASONING_TAGS[name], REASONING_PARSERS[name]


def test_reasoning_parser_plugin(thinking_model, tmp_path, plugin_parsers) -> None:
    """A ``--reasoning-parser-plugin`` file registers a parser (its own tags); the engine's
    grammars wait for that parser's tags, and the server's split uses it."""
    import argparse

    from omniserve.engine.processor import Processor
    from omniserve.entrypoints.openai.reasoning import REASONING_PARSERS

    plugin = tmp_path / "parsers.py"
    plugin.write_text(
        "from omniserve.entrypoints.openai.reasoning import ReasoningParser, "
        "register_reasoning_parser\n"
        "register_reasoning_parser('tagged', ReasoningParser('<think>', '</think>'))\n"
        "register_reasoning_parser('other', ReasoningParser('<r>', '</r>'))\n"
    )
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--reasoning-parser", "tagged", "--reasoning-parser-plugin",
                              str(plugin)])  # fmt: skip
    config = EngineArgs.from_cli_args(argparse.Namespace(model=thinking_model, **vars(args)))
    config = config.create_config()
    assert config.structured_outputs_config.reasoning_parser == "tagged"
    processor = Processor(config)
    processed = processor.process_inputs("r", {"prompt_token_ids": [1, 2]}, _params())
    constraint = processed.engine_requests[0].sampling_params.structured_outputs
    start, end = processor.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert constraint is not None and constraint.after_thinking == (start, end)
    assert REASONING_PARSERS["other"].split("<r>why</r>\nbecause") == ("why", "because")
    # A name no file registered, a file that fails, a parser without two tags.
    with pytest.raises(ValueError, match="a --reasoning-parser-plugin file registers more"):
        EngineArgs(thinking_model, reasoning_parser="unknown").create_config()
    plugin.write_text("raise RuntimeError('broken')\n")
    with pytest.raises(ValueError, match="--reasoning-parser-plugin .* failed to load"):
        EngineArgs(thinking_model, reasoning_parser_plugin=str(plugin)).create_config()
    with pytest.raises(ValueError, match="not a Python file"):
        EngineArgs(thinking_model, reasoning_parser_plugin=str(tmp_path / "no.py")).create_config()
    from omniserve.entrypoints.openai.reasoning import ReasoningParser, register_reasoning_parser

    with pytest.raises(ValueError, match="two different, non-empty tags"):
        register_reasoning_parser("same", ReasoningParser("<x>", "<x>"))

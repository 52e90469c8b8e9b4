"""Media reuse by ``uuid`` (vLLM's semantics): an item sent with a uuid is known by it; sent
again as None (offline) or as a part with only its uuid (API), it is the same item — same
answer, no HF processing — and an unknown uuid is a clear error naming the part."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omniserve import LLM, SamplingParams
from omniserve.multimodal.errors import MultiModalInputError
from tests.server_utils import MODEL, Server, assert_error
from tests.test_api_multimodal import IMAGE, _png

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is it?"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        engine = LLM(
            str(tiny_checkpoint("Qwen2VLForConditionalGeneration")),
            dtype="float32",
            max_model_len=512,
            kv_cache_memory="16MiB",
        )
    yield engine
    engine.llm_engine.shutdown()


def _ask(llm: LLM, images: list[Any], uuids: list[str | None] | None = None) -> list[int]:
    prompt: dict[str, Any] = {"prompt": PROMPT * len(images), "multi_modal_data": {"image": images}}
    if uuids is not None:
        prompt["multi_modal_uuids"] = {"image": uuids}
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_an_item_sent_by_uuid_alone_is_the_one_sent_before(llm: LLM) -> None:
    cache = llm.llm_engine.processor.mm_processor.cache
    other = Image.fromarray(np.full((56, 56, 3), 200, dtype=np.uint8))
    direct, both = _ask(llm, [IMAGE]), _ask(llm, [other, IMAGE])
    assert _ask(llm, [IMAGE], ["photo-1"]) == direct
    processed = cache.stats().misses
    assert _ask(llm, [None], ["photo-1"]) == direct  # no data: the kept image
    assert _ask(llm, [other, None], [None, "photo-1"]) == both
    assert cache.stats().misses == processed  # the kept item was never processed again
    # The uuid is the identity: other pixels under a known uuid are that uuid's item.
    assert _ask(llm, [other], ["photo-1"]) == direct


def test_reset_mm_cache_forgets_processed_media(llm: LLM) -> None:
    """vLLM's ``LLM.reset_mm_cache``: the processor cache and the encoder outputs no request
    holds are dropped (a uuid sent before then names nothing); answers are unchanged."""
    cache = llm.llm_engine.processor.mm_processor.cache
    encoder = llm.llm_engine.engine_core.engine_core.scheduler.encoder_cache_manager
    before = _ask(llm, [IMAGE], ["kept"])
    assert len(cache) and encoder.entries
    llm.reset_mm_cache()
    assert len(cache) == 0 and not encoder.entries
    with pytest.raises(MultiModalInputError, match="no image is kept under uuid 'kept'"):
        _ask(llm, [None], ["kept"])
    misses = cache.stats().misses
    assert _ask(llm, [IMAGE]) == before and cache.stats().misses > misses


@pytest.mark.parametrize(
    ("images", "uuids", "needle"),
    [
        ([None], ["never-sent"], "no image is kept under uuid 'never-sent'"),
        ([None], [None], "item 0 has neither data nor a uuid"),
        ([IMAGE, IMAGE], ["a"], "one uuid .* or None per item: 1 for 2 items"),
        ([IMAGE], [""], "non-empty string"),
    ],
)
def test_bad_uuids_are_errors_naming_the_item(
    llm: LLM, images: list, uuids: list, needle: str
) -> None:
    with pytest.raises(MultiModalInputError, match=needle):
        _ask(llm, images, uuids)


def test_the_api_reuses_parts_by_uuid(default_server: Server) -> None:
    url = "data:image/png;base64," + base64.b64encode(_png(IMAGE)).decode()

    def ask(part: dict[str, Any]) -> Any:
        return default_server.post(
            "/v1/chat/completions",
            {
                "model": MODEL,
                "max_tokens": 5,
                "temperature": 0.0,
                "messages": [
                    {"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}
                ],
            },
        )

    first = ask({"type": "image_url", "image_url": {"url": url}, "uuid": "api-photo"}).json()
    again = ask({"type": "image_url", "image_url": None, "uuid": "api-photo"}).json()
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert (
        again["usage"]["prompt_tokens_details"]["image_tokens"]
        == first["usage"]["prompt_tokens_details"]["image_tokens"]
        > 0
    )
    error = assert_error(ask({"type": "image_url", "uuid": "unknown"}), 400)
    assert "messages[0].content[0]" in error["message"] and "uuid 'unknown'" in error["message"]
    error = assert_error(ask({"type": "image_url", "image_url": {"url": url}, "uuid": 7}), 400)
    assert "messages[0].content[0].uuid must be a non-empty string" in error["message"]

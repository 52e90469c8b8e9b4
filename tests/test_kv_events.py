"""``--kv-events-config`` (vLLM's): the prefix cache's changes published on ZeroMQ in vLLM's wire
format, checked here as msgpack arrays (what vLLM's subscribers' structs decode: a batch is
``[ts, events, data_parallel_rank]``, an event ``[tag, fields...]``), with the replay socket
answering from a sequence number; the config is checked at start."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from omniserve import LLM, SamplingParams
from omniserve.config.kv_events import KVEventsConfig
from omniserve.engine.arg_utils import json_arg
from tests.hf_reference import make_prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receive(sub: zmq.Socket, topic: bytes) -> tuple[int, list[Any]]:
    """(sequence number, the batch as msgpack arrays)."""
    assert sub.poll(10_000), "no KV event batch arrived"
    got_topic, seq, payload = sub.recv_multipart()
    assert got_topic == topic
    return int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)


def test_events_reach_a_subscriber_and_replay(tiny_checkpoint) -> None:
    model = str(tiny_checkpoint("Qwen3ForCausalLM"))
    port, replay_port = _free_port(), _free_port()
    llm = LLM(model, dtype="float32", max_model_len=128, block_size=16,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://*:{port}", "topic": "kv",
                                "replay_endpoint": f"tcp://*:{replay_port}"})  # fmt: skip
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.5)  # a PUB socket drops what it sends before the subscription arrives
    try:
        prompt = make_prompts(model, [40])[0]
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
        seq, batch = _receive(sub, b"kv")
        ts, (stored,), rank = batch
        assert seq == 0 and ts > 0 and rank is None  # data_parallel_rank: one engine
        tag, hashes, parent, token_ids, block_size, lora_id, medium = stored
        assert (tag, parent, token_ids, block_size, lora_id, medium) == (
            "BlockStored", None, prompt[:32], 16, None, "GPU")  # fmt: skip
        assert len(hashes) == 2 and all(0 <= h < 1 << 64 for h in hashes)
        assert llm.reset_prefix_cache()
        seq, batch = _receive(sub, b"kv")
        assert seq == 1 and batch[1] == [["AllBlocksCleared"]]

        replay = context.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send((0).to_bytes(8, "big"))
        replies = []
        while True:
            assert replay.poll(10_000), "the replay socket did not answer"
            number, payload = replay.recv_multipart()
            if not payload:
                assert int.from_bytes(number, "big", signed=True) == -1
                break
            replies.append((int.from_bytes(number, "big"), msgspec.msgpack.decode(payload)[1]))
        assert replies == [(0, [stored]), (1, [["AllBlocksCleared"]])]
    finally:
        context.destroy(linger=0)
        llm.llm_engine.shutdown()


def test_config_is_checked() -> None:
    def parse(value: object) -> KVEventsConfig | None:
        """As ``EngineArgs`` reads the flag: JSON text, a dict or None."""
        return KVEventsConfig.from_dict(json_arg("kv_events_config", value))  # type: ignore[arg-type]

    assert parse(None) is None and parse({"enable_kv_cache_events": False}) is None
    config = parse('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:6000"}')
    assert config is not None and config.endpoint == "tcp://*:5557"
    assert config.endpoint_of(2) == "tcp://*:5559"
    assert config.endpoint_of(2, config.replay_endpoint) == "tcp://*:6002"
    assert config.endpoint_of(0) == "tcp://*:5557"
    assert KVEventsConfig(True, endpoint="ipc:///tmp/kv").endpoint_of(3) == "ipc:///tmp/kv"
    for value, message in (
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher must be one of"),
        ({"enable_kv_cache_events": True, "hwm": 0}, "hwm must be an integer >= 1"),
        ({"enable": True}, r"unknown key\(s\) \['enable'\]"),
        ("{", "--kv-events-config must be JSON"),
        ("[]", "--kv-events-config must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=message):
            parse(value)


def test_an_endpoint_in_use_fails_start_up_naming_it() -> None:
    from omniserve.engine.kv_event_publisher import KVEventPublisher

    port = _free_port()
    first = KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}"))
    try:
        with pytest.raises(ValueError, match=rf"--kv-events-config: cannot open tcp://\*:{port}"):
            KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}"))
    finally:
        first.shutdown()
    KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}")).shutdown()  # freed

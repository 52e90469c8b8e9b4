"""vLLM's --prefix-caching-hash-algo: the CBOR choices give vLLM's keys (its chain written out
here from its definition: the hash of canonical CBOR of (parent digest, token ids, extra keys or
None), the first parent the hash of PYTHONHASHSEED), the others keys equal in every process; the
prefix cache hits under each."""

from __future__ import annotations

import hashlib
import logging

import cbor2
import msgspec
import pytest
import xxhash

from omniserve.config import PREFIX_CACHING_HASH_ALGOS, CacheConfig
from omniserve.core.block_hash import ROOT_BLOCK_HASH, BlockHasher
from omniserve.core.kv_cache_manager import block_extra_keys
from omniserve.lora.request import LoRARequest
from tests.utils import (
    make_request,
    make_requests,
    make_runner_output,
    make_scheduler,
    run_to_completion,
)

DIGESTS = {"sha256": lambda b: hashlib.sha256(b).digest(), "xxhash": xxhash.xxh3_128_digest}


@pytest.mark.parametrize("family", ["sha256", "xxhash"])
def test_cbor_keys_are_vllms(family, monkeypatch):
    digest = DIGESTS[family]
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    hasher = BlockHasher(f"{family}_cbor")

    def vllm(parent: bytes, tokens: tuple, extra: tuple | None) -> bytes:
        return digest(cbor2.dumps((parent, tokens, extra), canonical=True))

    none_hash = digest(cbor2.dumps("42", canonical=True))
    first = vllm(none_hash, (1, 2, 3, 4), ("salt",))
    second = vllm(first, (5, 6, 7, 8), None)
    ours_first = hasher(ROOT_BLOCK_HASH, [1, 2, 3, 4], ("salt",))
    assert ours_first == int.from_bytes(first, "big")
    assert hasher(ours_first, [5, 6, 7, 8], ()) == int.from_bytes(second, "big")
    # KV events publish the low 64 bits, as vLLM's integer block hashes
    assert ours_first & (2**64 - 1) == int.from_bytes(first, "big") & ((1 << 64) - 1)


def test_cbor_without_a_seed_is_random_per_process(monkeypatch, caplog):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with caplog.at_level(logging.WARNING):
        a, b = BlockHasher("sha256_cbor"), BlockHasher("sha256_cbor")
    assert a(ROOT_BLOCK_HASH, [1], ()) != b(ROOT_BLOCK_HASH, [1], ())
    assert "PYTHONHASHSEED is not set" in caplog.text


@pytest.mark.parametrize("family", ["sha256", "xxhash"])
def test_plain_keys_need_no_seed(family, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    digest = DIGESTS[family]
    size = len(digest(b""))
    expected = digest(bytes(size) + msgspec.msgpack.encode(([1, 2], ["x"])))
    assert BlockHasher(family)(ROOT_BLOCK_HASH, [1, 2], ("x",)) == int.from_bytes(expected, "big")


def test_extra_keys_in_vllms_order():
    """LoRA name (every block), items as (identifier, offset in the block), the salt (first
    block): vLLM's layout, so a router mixing in a salt or an adapter computes the same key."""
    request = make_request("a", list(range(1000, 1040)), mm_positions=[(20, 8)],
                           mm_hashes=["img"])  # fmt: skip
    request.cache_salt = "s"
    request.lora_request = LoRARequest("adapter", 1, "/nowhere")
    assert block_extra_keys(request, 0, 16) == ("adapter", "s")
    assert block_extra_keys(request, 16, 32) == ("adapter", ("img", 4))
    assert block_extra_keys(request, 32, 40) == ("adapter",)


@pytest.mark.parametrize("algo", PREFIX_CACHING_HASH_ALGOS)
def test_prefix_cache_hits_under_each(algo, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    scheduler = make_scheduler(block_size=16, prefix_caching_hash_algo=algo)
    first, second = make_requests(2, 40, same_prompt=True, max_tokens=2)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    scheduler.add_request(second)
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    scheduler.update_from_output(so, make_runner_output(scheduler, so))


def test_bad_choice():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of sha256"):
        CacheConfig(prefix_caching_hash_algo="md5")

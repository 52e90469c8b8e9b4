"""Prefix-cache block hashes: each full block's key chains its parent's, its token ids and what
else decides its KV (``kv_cache_manager.block_extra_keys``), by one of vLLM's
``--prefix-caching-hash-algo`` choices:

- "sha256" (the default) and "xxhash" (xxh3-128, faster): over the parent's digest and the
  tokens and keys in msgpack; the first block's parent is all zero bytes, so the keys are the
  same in every process and across restarts (vLLM's, over pickle, have a random root unless
  ``PYTHONHASHSEED`` is set).
- "sha256_cbor" and "xxhash_cbor": vLLM's, the hash of canonical CBOR of ``(parent digest,
  token ids, extra keys or None)``, the first block's parent the hash of ``PYTHONHASHSEED`` (32
  random bytes without it, as vLLM, which warns), so a router computing vLLM's keys for a text
  prompt (llm-d's KV-cache indexer, say) finds the blocks these KV events name.

Keys are ints (the digest, big-endian); KV events publish their low 64 bits, as vLLM's integer
block hashes. Pure Python (no torch).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from omniserve.config import PREFIX_CACHING_HASH_ALGOS

logger = logging.getLogger(__name__)

ROOT_BLOCK_HASH = 0
"""The parent of a request's first block (a digest of all zeros never occurs)."""


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError as exc:  # (a dependency; a trimmed environment may lack it)
        raise ValueError("--prefix-caching-hash-algo xxhash needs the xxhash package "
                         "(pip install xxhash).") from exc  # fmt: skip
    return xxhash.xxh3_128_digest(data)


def _cbor(value: Any) -> bytes:
    import cbor2

    return cbor2.dumps(value, canonical=True)


class BlockHasher:
    """The chained block hash of one algorithm (``PREFIX_CACHING_HASH_ALGOS``)."""

    def __init__(self, algo: str = "sha256") -> None:
        if algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"--prefix-caching-hash-algo must be one of "
                             f"{', '.join(PREFIX_CACHING_HASH_ALGOS)}, not {algo!r}.")  # fmt: skip
        self.algo = algo
        self.cbor = algo.endswith("_cbor")
        self._digest: Callable[[bytes], bytes] = _sha256 if algo.startswith("sha256") else _xxh3_128
        self.size = len(self._digest(b""))
        self.root = bytes(self.size)
        if self.cbor:  # vLLM's NONE_HASH
            seed = os.environ.get("PYTHONHASHSEED")
            if seed is None:
                logger.warning("PYTHONHASHSEED is not set: %s block hashes differ from one "
                               "process to the next (as vLLM's).", algo)  # fmt: skip
                self.root = os.urandom(32)
            else:
                self.root = self._digest(_cbor(seed))

    def __call__(self, parent: int, token_ids: Sequence[int], extra_keys: tuple | None) -> int:
        """The key of a block of ``token_ids`` after the block ``parent`` (``ROOT_BLOCK_HASH``:
        the first); ``extra_keys`` None or empty: none."""
        parent_bytes = self.root if parent == ROOT_BLOCK_HASH else parent.to_bytes(self.size, "big")
        if self.cbor:
            data = _cbor((parent_bytes, tuple(token_ids), extra_keys or None))
        else:
            data = parent_bytes + msgspec.msgpack.encode((list(token_ids), extra_keys or ()))
        return int.from_bytes(self._digest(data), "big")


hash_block_tokens = BlockHasher()
"""The default ("sha256") block hash."""

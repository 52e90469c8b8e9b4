"""Data parallelism, client side: which engine core gets a request, how the engines' answers
combine, and what each engine process sees of the machine.

``--data-parallel-size N`` runs N independent engine cores (own process, scheduler and KV cache)
behind one front end; the client (``MPClient``) uses this module. Pure Python (no torch), so the
policy is unit-tested without engines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

_USAGE_KEYS = {"kv_cache_usage": "num_kv_blocks", "encoder_cache_usage": None}
"""Fractions that average over engines (weighted by this stat, or evenly); other stats add up."""


class LoadBalancer:
    """Routes each new request to the engine core with the fewest outstanding requests.

    Outstanding means routed and not yet finished or aborted. It is counted here, on the client,
    because it is exact the moment a request is routed, while an engine's own waiting/running
    counts lag by a step. Ties go to the lowest rank. Not thread-safe: the front end routes,
    finishes and aborts from one thread (or event loop).
    """

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}.")
        self.num_outstanding = [0] * num_engines
        """engine rank -> requests it holds"""
        self.request_to_engine: dict[str, int] = {}

    def route(self, request_ids: list[str]) -> int:
        """Pick one engine for ``request_ids`` and record them there.

        A group stays together: the ``n`` samples of one prompt share its prefix cache.
        """
        engine = min(range(len(self.num_outstanding)), key=self.num_outstanding.__getitem__)
        for request_id in request_ids:
            self.request_to_engine[request_id] = engine
        self.num_outstanding[engine] += len(request_ids)
        return engine

    def release(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Forget finished or aborted requests; returns engine rank -> the ids it held.

        Unknown ids (already released) are skipped, so a finish racing an abort counts once.
        """
        engine_to_ids: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self.request_to_engine.pop(request_id, None)
            if engine is not None:
                self.num_outstanding[engine] -= 1
                engine_to_ids.setdefault(engine, []).append(request_id)
        return engine_to_ids


def combine_stats(engine_stats: list[dict[str, float]]) -> dict[str, float]:
    """One engine's view of N engines: counts and counters add up, usage fractions average
    (KV usage weighted by each engine's number of blocks)."""
    combined: dict[str, float] = {}
    for key in engine_stats[0]:
        values = [stats.get(key, 0.0) for stats in engine_stats]
        if key not in _USAGE_KEYS:
            combined[key] = sum(values)
            continue
        weight_key = _USAGE_KEYS[key]
        weights = [stats.get(weight_key, 1.0) if weight_key else 1.0 for stats in engine_stats]
        total = sum(weights)
        weighted = sum(v * w for v, w in zip(values, weights, strict=True))
        combined[key] = weighted / total if total else 0.0
    return combined


def combine_step_timings(results: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Engines' step timings summed: seconds are engine-seconds (the engines run side by side)."""
    return {
        group: {key: sum(r[group][key] for r in results) for key in results[0][group]}
        for group in results[0]
    }


_COMBINE_RESULTS: dict[str, Callable[[list[Any]], Any]] = {
    "get_stats": combine_stats,
    "reset_prefix_cache": all,  # True only if every engine's cache was reset
    "reset_encoder_cache": lambda _: None,
    "has_unfinished_requests": any,
    "start_step_timing": lambda _: None,
    "get_step_timings": combine_step_timings,
    "profile": lambda _: None,
    "sleep": lambda _: None,
    "wake_up": lambda _: None,
    "is_sleeping": any,
    "collective_rpc": lambda per_engine: [r for results in per_engine for r in results],
}


def combine_results(method: str, results: list[Any]) -> Any:
    """The answer of a utility called on every engine; unknown methods give the list by rank."""
    if len(results) == 1:
        return results[0]
    return _COMBINE_RESULTS.get(method, list)(results)


def engine_env(
    rank: int,
    data_parallel_size: int,
    world_size: int,
    num_cpus: int,
    user_num_threads: int | None,
    cuda_devices: list[str] | None,
) -> dict[str, str]:
    """Environment overrides for engine ``rank``'s process (and the workers it starts).

    ``cuda_devices``: the devices visible to the front end when the engines run on CUDA (else
    None); engine ``rank`` gets the ``world_size`` of them starting at ``rank * world_size``.
    On CPU, engines share the cores: each engine gets ``num_cpus / engines`` torch threads
    (``OMNISERVE_NUM_THREADS``, which its tensor-parallel workers split among themselves) unless
    the user set that variable, so N engines do not oversubscribe the machine.
    """
    env: dict[str, str] = {}
    if data_parallel_size == 1:
        return env  # one engine: the machine as it is
    if cuda_devices is not None:
        needed = data_parallel_size * world_size
        if len(cuda_devices) < needed:
            raise ValueError(
                f"data_parallel_size={data_parallel_size} x {world_size} GPU(s) per engine needs "
                f"{needed} GPUs, but {len(cuda_devices)} are visible."
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            cuda_devices[rank * world_size : (rank + 1) * world_size]
        )
    if user_num_threads is None:
        threads = max(1, num_cpus // data_parallel_size)
        env["OMNISERVE_NUM_THREADS"] = str(threads)
    return env

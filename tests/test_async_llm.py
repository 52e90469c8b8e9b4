"""AsyncLLM's several-prompt generation (``generate_many``, what a server request with several
prompts and each beam search step use): added together, all or nothing, and aborted when the
consumer leaves while they are being added."""

from __future__ import annotations

import asyncio
from typing import Any

from omniserve import SamplingParams
from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.async_llm import AsyncLLM
from omniserve.outputs import RequestOutput
from omniserve.sampling_params import RequestOutputKind
from tests.hf_reference import make_prompts


async def _final(generator: Any) -> RequestOutput:
    async for output in generator:
        final = output
    return final


def test_generate_many_adds_together_and_all_or_nothing(tiny_checkpoint: Any) -> None:
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    prompts: list[Any] = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [9] * 8)]
    ids = [f"r{i}" for i in range(len(prompts))]

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model_dir, max_model_len=256, kv_cache_memory="16MiB")
        )
        try:
            core = engine.engine_core
            # Their first step takes them all (added one by one, it could start on one).
            await core.call_utility_async("start_step_timing")
            one = SamplingParams(max_tokens=1)
            finals = await asyncio.gather(*map(_final, engine.generate_many(prompts, one, ids)))
            assert [f.request_id for f in finals] == ids and all(f.finished for f in finals)
            timings = await core.call_utility_async("get_step_timings")
            assert timings["steps"] == {"prefill": 1.0, "decode": 0.0}
            # A bad prompt: every generator raises its error and none was added.
            bad = [prompts[0], {"prompt_token_ids": [10**7]}]
            results = await asyncio.gather(
                *map(_final, engine.generate_many(bad, one, ["a", "b"])), return_exceptions=True
            )
            assert all(isinstance(r, ValueError) and "vocabulary" in str(r) for r in results)
            assert not engine.output_processor.has_unfinished_requests()
            # The consumers leave while their requests are being added: once added, aborted.
            aborted: list[str] = []
            abort = engine.abort

            async def recording_abort(request_id: str | list[str]) -> None:
                aborted.append(request_id)  # type: ignore[arg-type]
                await abort(request_id)

            engine.abort = recording_abort  # type: ignore[method-assign]
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            generators = engine.generate_many(prompts, long, [f"x{i}" for i in ids])
            firsts = [asyncio.ensure_future(anext(g)) for g in generators]
            await asyncio.sleep(0)  # every one is waiting for the add
            for task in firsts:
                task.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            for _ in range(500):
                if len(aborted) == len(ids):
                    break
                await asyncio.sleep(0.01)
            assert sorted(aborted) == sorted(f"x{i}" for i in ids)
            assert not engine.output_processor.has_unfinished_requests()
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_stream_interval_batches_streamed_tokens(tiny_checkpoint: Any) -> None:
    """--stream-interval 4: a streamed answer of 10 tokens arrives as 1 + 4 + 4 + 1 tokens,
    the same tokens as streaming each one."""
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    (prompt,) = make_prompts(model_dir, [9])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip

    async def stream(interval: int) -> list[list[int]]:
        engine = AsyncLLM.from_engine_args(EngineArgs(
            model_dir, max_model_len=256, kv_cache_memory="16MiB", stream_interval=interval
        ))  # fmt: skip
        try:
            return [list(o.outputs[0].token_ids) async for o in
                    engine.generate({"prompt_token_ids": prompt}, params, "s")]  # fmt: skip
        finally:
            engine.shutdown()

    each, grouped = asyncio.run(stream(1)), asyncio.run(stream(4))
    assert [len(ids) for ids in each] == [1] * 10
    assert [len(ids) for ids in grouped] == [1, 4, 4, 1]
    assert sum(grouped, []) == sum(each, [])

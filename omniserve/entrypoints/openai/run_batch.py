"""``omniserve run-batch``: vLLM's ``run-batch``. An OpenAI batch file (JSONL, one request a line:
``custom_id``, ``method``, ``url``, ``body``) is answered by the server's own routes, run in this
process without a socket, into a JSONL file of OpenAI's batch output lines, in input order: the
same validation, defaults, media handling, errors and answers as ``omniserve serve`` gives.
Twice ``--max-num-seqs`` lines are in flight at a time, and answers are written as they complete.
As in vLLM, the input may be an http(s) URL (fetched) and the output one too (the file is written
locally, under ``--output-tmp-dir``, then sent with PUT, as a presigned upload URL takes it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pydantic
from tqdm import tqdm

from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.async_llm import AsyncLLM
from omniserve.entrypoints.openai.api_server import build_app, log_stats
from omniserve.entrypoints.openai.protocol import validation_message
from omniserve.lora.request import parse_lora_modules

logger = logging.getLogger(__name__)

IN_FLIGHT_PER_SEAT = 2
"""Lines in flight per ``--max-num-seqs`` seat: enough to keep the engine full, few enough that
a large file's lines are not all being processed (their media decoded) at once."""
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
              "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify",
              "/pooling")  # fmt: skip
"""The routes a batch line may name (OpenAI's Batch API has the first four; vLLM's run-batch
the pooling ones too)."""


class BatchRequestInput(pydantic.BaseModel):
    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class BatchResponseData(pydantic.BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]
    """The route's JSON answer: its response, or its error (``{"error": {...}}``)."""


class BatchError(pydantic.BaseModel):
    code: str
    message: str


class BatchRequestOutput(pydantic.BaseModel):
    id: str
    custom_id: str | None
    response: BatchResponseData | None
    """The HTTP answer (a 400 included); None when the line never reached a route."""
    error: BatchError | None


async def run_batch(args: argparse.Namespace) -> None:
    """Answer ``args.input_file`` into ``args.output_file`` (either may be an http(s) URL)."""
    text = await read_input(args.input_file)
    lines = [line for line in text.splitlines() if line.strip()]
    with _output_path(args.output_file, args.output_tmp_dir) as path:
        await _run(args, lines, path)
        if _is_url(args.output_file):
            await upload_output(path, args.output_file)


def _is_url(location: str) -> bool:
    return location.startswith(("http://", "https://"))


async def read_input(location: str) -> str:
    """The batch file's text: a local file, or what an http(s) URL answers (an error status is
    an error naming it)."""
    if not _is_url(location):
        return Path(location).read_text()
    async with httpx.AsyncClient(follow_redirects=True, timeout=60) as client:
        response = await client.get(location)
    if response.status_code != 200:
        raise RuntimeError(f"GET {location} answered {response.status_code}: {response.text[:200]}")
    return response.text


@contextlib.contextmanager
def _output_path(location: str, tmp_dir: str | None) -> Iterator[Path]:
    """Where answers are written: the output file itself, or a temporary file for a URL."""
    if not _is_url(location):
        yield Path(location)
        return
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="omniserve-batch-") as folder:
        yield Path(folder) / "output.jsonl"


async def upload_output(path: Path, location: str) -> None:
    """PUT the answers to ``location`` (a presigned URL takes a plain PUT of the bytes)."""
    async with httpx.AsyncClient(timeout=300) as client:
        response = await client.put(location, content=path.read_bytes(),
                                    headers={"Content-Type": "application/jsonl"})  # fmt: skip
    if response.status_code >= 300:
        raise RuntimeError(f"PUT {location} answered {response.status_code}: {response.text[:200]}")
    logger.info("Uploaded the answers to %s.", location)


async def _run(args: argparse.Namespace, lines: list[str], output_path: Path) -> None:
    engine_args = EngineArgs.from_cli_args(args)
    engine = AsyncLLM.from_engine_args(
        engine_args, stat_loggers=log_stats(args), input_threads=args.input_processing_threads
    )
    try:
        args.no_playground = True
        app = build_app(engine, args)
        for name, path, base in parse_lora_modules(args.lora_modules):
            await app.state.models.load(name, path, base)
        transport = httpx.ASGITransport(app=app)
        window = asyncio.Semaphore(IN_FLIGHT_PER_SEAT * engine.config.scheduler_config.max_num_seqs)
        repeated = _repeated_ids(lines)
        failed = 0
        async with httpx.AsyncClient(transport=transport, base_url="http://batch") as client:

            async def answer(number: int, line: str) -> BatchRequestOutput:
                async with window:
                    return await _answer(client, number, line, repeated, bar)

            with (
                open(output_path, "w") as out,
                tqdm(total=len(lines), unit="req", desc="Running batch") as bar,
            ):
                tasks = [asyncio.ensure_future(answer(i + 1, line)) for i, line in enumerate(lines)]
                try:
                    for task in tasks:  # written in input order as they complete
                        output = await task
                        out.write(output.model_dump_json() + "\n")
                        failed += output.response is None or output.response.status_code != 200
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        engine.shutdown()
    logger.info("Wrote %d answers to %s (%d failed).", len(lines), output_path, failed)


async def _answer(
    client: httpx.AsyncClient, number: int, line: str, repeated: set[str], bar: tqdm
) -> BatchRequestOutput:
    output_id = f"batch_req_{uuid.uuid4().hex}"
    try:
        request = BatchRequestInput.model_validate_json(line)
    except pydantic.ValidationError as exc:
        custom_id = _custom_id(line)
        return _failed(output_id, custom_id, f"line {number}: {validation_message(exc)}", bar)
    if request.custom_id in repeated:
        message = f"line {number}: custom_id {request.custom_id!r} is not unique in the file."
        return _failed(output_id, request.custom_id, message, bar)
    if request.url not in BATCH_URLS:
        message = f"line {number}: url {request.url!r} is not one of {list(BATCH_URLS)}."
        return _failed(output_id, request.custom_id, message, bar, code="invalid_url")
    if request.body.get("stream"):
        message = f"line {number}: body.stream: a batch answers whole, not streamed."
        return _failed(output_id, request.custom_id, message, bar)
    response = await client.post(request.url, json=request.body, timeout=None)
    body = response.json()
    bar.update()
    request_id = body.get("id") if isinstance(body.get("id"), str) else output_id
    return BatchRequestOutput(
        id=output_id,
        custom_id=request.custom_id,
        response=BatchResponseData(
            status_code=response.status_code, request_id=request_id, body=body
        ),
        error=None,
    )


def _failed(
    output_id: str, custom_id: str | None, message: str, bar: tqdm, code: str = "invalid_request"
) -> BatchRequestOutput:
    bar.update()
    return BatchRequestOutput(
        id=output_id,
        custom_id=custom_id,
        response=None,
        error=BatchError(code=code, message=message),
    )


def _custom_id(line: str) -> str | None:
    """A malformed line's custom_id, when it has a readable one."""
    try:
        custom_id = json.loads(line).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return custom_id if isinstance(custom_id, str) else None


def _repeated_ids(lines: list[str]) -> set[str]:
    counts = Counter(_custom_id(line) for line in lines)
    return {custom_id for custom_id, n in counts.items() if custom_id is not None and n > 1}

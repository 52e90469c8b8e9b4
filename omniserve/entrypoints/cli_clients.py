"""``omniserve chat`` and ``omniserve complete``: vLLM's command-line clients of a running server
(``vllm chat`` / ``vllm complete``), through the OpenAI SDK: one message (``--quick``) or a
conversation on standard input, answers streamed as they come."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

import openai


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default="http://localhost:8000/v1", help="The server's OpenAI API base URL."
    )
    parser.add_argument(
        "--model-name", default=None, help="The model to ask (default: the server's first)."
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="The server's --api-key (default: $OPENAI_API_KEY, else none).",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="Cap on each answer.")
    parser.add_argument(
        "-q", "--quick", default=None, metavar="TEXT", help="Send TEXT, print the answer, exit."
    )


def chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    client, model = _connect(args)
    messages: list[Any] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    status = 0
    for text in _inputs(args, stdin, out, "Please enter a message for the chat model:"):
        try:
            stream = client.chat.completions.create(
                model=model, messages=[*messages, {"role": "user", "content": text}],
                max_tokens=_limit(args), stream=True,
            )  # fmt: skip
            answer = _print_stream(
                (chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices), out
            )
        except openai.APIError as exc:
            status = _report(exc, out)
            continue
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
    return status


def complete(args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    client, model = _connect(args)
    status = 0
    for prompt in _inputs(args, stdin, out, "Please enter prompt to complete:"):
        try:
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=_limit(args), stream=True
            )
            _print_stream((chunk.choices[0].text for chunk in stream if chunk.choices), out)
        except openai.APIError as exc:
            status = _report(exc, out)
    return status


def _report(exc: openai.APIError, out: TextIO) -> int:
    """The server's refusal, said; the conversation goes on (exit status 1 at the end)."""
    print(f"\nError: {exc.message}", file=out)
    return 1


def _limit(args: argparse.Namespace) -> Any:
    return openai.NOT_GIVEN if args.max_tokens is None else args.max_tokens


def _connect(args: argparse.Namespace) -> tuple[openai.OpenAI, str]:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    client = openai.OpenAI(base_url=args.url, api_key=api_key)
    try:
        model = args.model_name or client.models.list().data[0].id
    except openai.APIConnectionError as exc:
        raise ValueError(f"No server answers at {args.url} ({exc}).") from exc
    return client, model


def _inputs(args: argparse.Namespace, stdin: TextIO, out: TextIO, invite: str) -> Any:
    """``--quick``'s text alone, else each line of standard input until it ends."""
    if args.quick is not None:
        yield args.quick
        return
    print(invite, file=out)
    while True:
        print("> ", end="", file=out, flush=True)
        line = stdin.readline()
        if not line:
            print(file=out)
            return
        if line.strip():
            yield line.rstrip("\n")


def _print_stream(pieces: Any, out: TextIO) -> str:
    text = ""
    for piece in pieces:
        text += piece
        print(piece, end="", file=out, flush=True)
    print(file=out)
    return text

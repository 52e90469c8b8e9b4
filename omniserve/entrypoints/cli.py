"""The ``omniserve`` command: serve, generate, make-tiny, models."""

from __future__ import annotations

import argparse
import json
import sys

from omniserve.engine.arg_utils import EngineArgs

DEFAULT_ARCHITECTURE = "Qwen3OmniMoeThinkerForConditionalGeneration"


def default_model() -> str:
    """The built-in default model: a tiny Qwen3-Omni-MoE thinker (text, image, audio, video in),
    built offline on first use into the cache dir."""
    from omniserve.checkpoint_builder import build_tiny_checkpoint

    return str(build_tiny_checkpoint(DEFAULT_ARCHITECTURE))


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from omniserve.checkpoint_builder import build_tiny_checkpoint

    overrides = json.loads(args.overrides) if args.overrides else None
    path = build_tiny_checkpoint(args.architecture, args.out, size=args.size, seed=args.seed,
                                 overrides=overrides)
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from omniserve import LLM, SamplingParams

    model = args.model or default_model()
    llm = LLM(**vars(EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args),
                                                                     "model": model}))))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    prompts = args.prompt or ["Hello, my name is", "The capital of France is"]
    outputs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
               if args.chat else llm.generate(prompts, params))
    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"{prompt!r} -> {output.outputs[0].text!r}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from omniserve.entrypoints.openai.api_server import run_server

    if args.model is None:
        args.model = default_model()
    run_server(args)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from omniserve.plugins import load_plugins
    from omniserve.registry import ModelRegistry

    load_plugins()
    for entry in ModelRegistry.entries():
        print(f"{entry.architecture:45s} {entry.target:55s} {entry.source}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniserve", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    serve = sub.add_parser("serve", formatter_class=fmt,
                           help="Serve a model over an OpenAI-compatible HTTP API.")
    serve.add_argument("model", nargs="?", default=None,
                       help="Checkpoint dir. None: a tiny built-in model, built on first use.")
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="Address to bind (0.0.0.0 for every interface).")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on.")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="Names clients may use for the model; the first is reported. "
                             "None: the model path.")
    server.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' on the API routes.")
    server.add_argument("--chat-template", default=None,
                        help="A chat template file (or inline Jinja) replacing the checkpoint's.")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (info logs every request).")
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(func=_cmd_serve)

    tiny = sub.add_parser("make-tiny", formatter_class=fmt,
                          help="Build a tiny Hugging Face checkpoint offline.")
    tiny.add_argument("architecture", help="e.g. Qwen3ForCausalLM")
    tiny.add_argument("--out", default=None, help="Output dir (default: the cache dir).")
    tiny.add_argument("--size", default="tiny", choices=["tiny", "bench"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--overrides", default=None, help="JSON of config fields to override.")
    tiny.set_defaults(func=_cmd_make_tiny)

    gen = sub.add_parser("generate", formatter_class=fmt, help="Generate offline for prompts.")
    gen.add_argument("model", nargs="?", default=None,
                     help="Checkpoint dir (default: a tiny built-in model).")
    gen.add_argument("--prompt", action="append", help="A prompt (repeatable).")
    gen.add_argument("--chat", action="store_true", help="Wrap prompts in the chat template.")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_cmd_generate)

    models = sub.add_parser("models", help="List every registered architecture.")
    models.set_defaults(func=_cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"omniserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

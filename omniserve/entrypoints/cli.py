"""The ``omniserve`` command: serve, chat, complete, run-batch, generate, make-tiny, and the
model registry's commands."""

from __future__ import annotations

import argparse
import sys

from omniserve.config import SpeculativeConfig
from omniserve.engine.arg_checks import (
    MISSING_FEATURE_FLAGS,
    NO_EFFECT_FLAGS,
    check_vllm_only,
    number_in,
)
from omniserve.engine.arg_utils import EngineArgs, json_arg
from omniserve.entrypoints.chat_utils import CONTENT_FORMATS
from omniserve.entrypoints.cli_clients import add_client_args, chat, complete
from omniserve.entrypoints.cli_config import with_config_file
from omniserve.entrypoints.openai.server_args import add_server_args, check_server_args
from omniserve.entrypoints.openai.tool_parsers import (
    BUILT_IN_TOOL_CALL_PARSERS,
    TOOL_CALL_PARSERS,
)
from omniserve.lora.request import parse_lora_modules
from omniserve.plugins import run_plugin_file


def default_model() -> str:
    """The built-in default model: the demo Qwen3-Omni-MoE thinker shipped in the package
    (`omniserve.demo_model`), trained to answer about shapes in images, beeps in sounds and
    moving shapes in videos."""
    from omniserve.demo_model import CHECKPOINT

    return str(CHECKPOINT)


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from omniserve.checkpoint_builder import build_tiny_checkpoint

    overrides = json_arg("overrides", args.overrides) or None
    if args.as_architecture is None:
        path = build_tiny_checkpoint(
            args.architecture, args.out, size=args.size, seed=args.seed, overrides=overrides
        )
    else:
        from omniserve.plugin_tools.checkpoints import tiny_checkpoint_as

        path = tiny_checkpoint_as(
            args.architecture,
            args.as_architecture,
            args.out,
            size=args.size,
            seed=args.seed,
            overrides=overrides,
        )
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from omniserve import LLM, SamplingParams

    model = args.model or default_model()
    llm = LLM(
        **vars(EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "model": model})))
    )
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    prompts = args.prompt or ["Hello, my name is", "The capital of France is"]
    outputs = (
        llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        if args.chat
        else llm.generate(prompts, params)
    )
    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"{prompt!r} -> {output.outputs[0].text!r}")
    return 0


def _check_serve_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    flag = getattr(args, "model_flag", None)
    if flag is not None:
        if args.model not in (None, flag):
            parser.error(f"the model is given twice: {args.model!r} and --model {flag!r}.")
        args.model = flag
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes).")
    try:
        if args.tool_parser_plugin is not None:
            run_plugin_file(args.tool_parser_plugin, "--tool-parser-plugin")
    except ValueError as exc:
        parser.error(str(exc))
    if args.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        parser.error(
            f"--tool-call-parser {args.tool_call_parser!r} is none of {sorted(TOOL_CALL_PARSERS)} "
            "(a --tool-parser-plugin file registers more)."
        )
    if args.enable_log_outputs and not args.enable_log_requests:
        parser.error("--enable-log-outputs needs --enable-log-requests.")
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora.")
    try:
        parse_lora_modules(args.lora_modules)
    except ValueError as exc:
        parser.error(str(exc))
    if args.speculative_config is not None:
        try:
            SpeculativeConfig.from_dict(args.speculative_config)
            SpeculativeConfig.check_scheduling(args.async_scheduling)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        check_vllm_only(vars(args))
        check_server_args(args)
    except ValueError as exc:
        parser.error(str(exc))


def _default_model(args: argparse.Namespace) -> None:
    """No model given: the built-in one, under its served name."""
    if args.model is None:
        from omniserve.demo_model import SERVED_NAME

        args.model = default_model()
        args.served_model_name = args.served_model_name or [SERVED_NAME]


def _cmd_serve(args: argparse.Namespace) -> int:
    from omniserve.entrypoints.openai.api_server import run_server

    _default_model(args)
    run_server(args)
    return 0


def _cmd_run_batch(args: argparse.Namespace) -> int:
    import asyncio

    from omniserve.entrypoints.openai.run_batch import run_batch

    _default_model(args)
    asyncio.run(run_batch(args))
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from omniserve.plugin_tools.commands import format_rows, list_models

    print(format_rows(list_models()))
    return 0


def _cmd_register_model(args: argparse.Namespace) -> int:
    from omniserve.plugin_tools import commands

    if args.scaffold is not None:
        return _scaffold(args)
    for flag, value in (("--out", args.out), ("--from", args.base)):
        if value is not None:
            raise ValueError(f"{flag} goes with --scaffold NAME")
    if args.architecture is None:
        raise ValueError("register-model needs ARCH (or --scaffold NAME --out DIR)")
    if args.model is not None:
        ok = commands.register_model(
            args.architecture,
            args.model,
            processor=args.processor,
            path=args.path,
            force=args.force,
            check=args.check,
        )
        return 0 if ok else 1
    for flag, value in (
        ("--processor", args.processor),
        ("--path", args.path),
        ("--force", args.force or None),
    ):
        if value is not None:
            raise ValueError(f"{flag} goes with --model pkg.mod:Class")
    if args.check is None:
        raise ValueError(
            "pass --model pkg.mod:Class to register ARCH, or --check CKPT_DIR to "
            "validate a registered ARCH"
        )
    return 0 if commands.check_registered(args.architecture, args.check) else 1


def _scaffold(args: argparse.Namespace) -> int:
    from omniserve.plugin_tools.scaffold import DEFAULT_BASE_ARCHITECTURE, scaffold_plugin

    for flag, value in (
        ("--model", args.model),
        ("--processor", args.processor),
        ("--path", args.path),
        ("--check", args.check),
    ):
        if value is not None:
            raise ValueError(f"{flag} does not go with --scaffold")
    if args.out is None:
        raise ValueError("--scaffold NAME needs --out DIR")
    result = scaffold_plugin(
        args.scaffold,
        args.out,
        base_architecture=args.base or DEFAULT_BASE_ARCHITECTURE,
        architecture=args.architecture,
    )
    print(f"Wrote the {result.architecture} plugin to {result.project_dir}:")
    for file in result.files:
        print(f"  {file}")
    print(f"Next: cd {result.project_dir} && pip install -e . && python -m pytest")
    return 0


def _cmd_unregister_model(args: argparse.Namespace) -> int:
    from omniserve.plugin_tools.commands import unregister_model

    print(unregister_model(args.architecture))
    return 0


def _add_plugin_commands(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser(
        "models",
        help="List every registered architecture, its source "
        "(built-in, entry point, user file) and its inputs.",
    )
    models.set_defaults(func=_cmd_models)

    reg = sub.add_parser(
        "register-model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="Record, validate (--check) or scaffold (--scaffold) a model plugin.",
        description="""\
  omniserve register-model ARCH --model pkg.mod:Class [--processor pkg.mod:Class] [--path DIR]
      record ARCH in the user's registry file ($OMNISERVE_CONFIG_DIR/models.json, by default
      ~/.config/omniserve/models.json) after checking the classes' interface; with
      --check CKPT_DIR, only if the plugin also passes the check on that checkpoint
  omniserve register-model ARCH --check CKPT_DIR
      validate an already registered ARCH on a checkpoint (a pass/fail table; exit 1 on a failure)
  omniserve register-model [ARCH] --scaffold NAME --out DIR [--from BASE_ARCH]
      write a plugin package starting from a built-in model, ready to edit""",
    )
    reg.add_argument(
        "architecture",
        nargs="?",
        default=None,
        metavar="ARCH",
        help="The config.json 'architectures' name the plugin serves.",
    )
    reg.add_argument(
        "--model",
        default=None,
        metavar="pkg.mod:Class",
        help="The model class (an nn.Module with the engine's hooks).",
    )
    reg.add_argument(
        "--processor",
        default=None,
        metavar="pkg.mod:Class",
        help="Its multimodal processor, declaring info_cls and dummy_inputs_cls "
        "(default: the one attached to the model class, if any).",
    )
    reg.add_argument(
        "--path",
        default=None,
        metavar="DIR",
        help="A directory to put on sys.path (recorded; every process adds it).",
    )
    reg.add_argument(
        "--force",
        action="store_true",
        help="Replace an existing entry, or override a built-in / entry-point ARCH.",
    )
    reg.add_argument(
        "--check",
        default=None,
        metavar="CKPT_DIR",
        help="Validate on this checkpoint (a small one: it loads it three times, "
        "float32 on the CPU; its architecture may be the plugin's base).",
    )
    reg.add_argument(
        "--scaffold",
        default=None,
        metavar="NAME",
        help="Write a plugin package named NAME (a Python package name).",
    )
    reg.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="With --scaffold: the new project directory (absent or empty).",
    )
    reg.add_argument(
        "--from",
        dest="base",
        default=None,
        metavar="BASE_ARCH",
        help="With --scaffold: the registered model to start from "
        "(default Qwen2VLForConditionalGeneration).",
    )
    reg.set_defaults(func=_cmd_register_model)

    unreg = sub.add_parser(
        "unregister-model", help="Remove an architecture from the user's registry file."
    )
    unreg.add_argument("architecture", metavar="ARCH")
    unreg.set_defaults(func=_cmd_unregister_model)


def _add_serving_args(group: argparse._ArgumentGroup) -> None:
    """The flags of how requests are served, shared by ``serve`` and ``run-batch``."""
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="Do not log the stats line (throughput, requests, KV cache usage, prefix cache hit "
        "rate) every VLLM_LOG_STATS_INTERVAL seconds (10) while the engine works.",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Names clients may use for the model; the first is reported. None: the model path.",
    )
    group.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="Log each request's parameters (INFO) and prompt (DEBUG) as it is submitted.",
    )
    group.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="With --enable-log-requests: log each finished choice's text and token ids too.",
    )
    group.add_argument(
        "--max-log-len",
        type=number_in(int, 0),
        default=None,
        help="Most prompt/output characters and token ids a log line shows (default: all).",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help='LoRA adapters to serve, as name=path or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}; a request picks one with its model field.',
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="A chat template file (or inline Jinja) replacing the checkpoint's.",
    )
    group.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="How message content reaches the chat template: 'string' (parts joined into "
        "text), 'openai' (the list of parts), or 'auto' (what the template reads).",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Let requests bring their own chat_template (rendered in jinja's "
        "sandbox); without it such a request is a 400.",
    )
    group.add_argument(
        "--input-processing-threads",
        type=number_in(int, 1),
        default=1,
        help="Threads that run the HF processing of prompts with media, off "
        "the event loop (text is tokenized on a thread of its own).",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let the model decide when to call tools (tool_choice "auto", the '
        "default with tools); needs --tool-call-parser.",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        help="The format the model writes tool calls in: "
        f"{', '.join(BUILT_IN_TOOL_CALL_PARSERS)} (hermes: the Qwen family's <tool_call> "
        "blocks), or a name a --tool-parser-plugin registers.",
    )
    group.add_argument(
        "--tool-parser-plugin",
        default=None,
        metavar="FILE",
        help="A Python file run at start-up whose ToolCallReader subclasses, decorated with "
        "omniserve.entrypoints.openai.tool_parsers.register_tool_call_parser(NAME), read "
        "tool calls for --tool-call-parser NAME.",
    )
    group.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='With tool_choice "none", do not list the tools in the prompt.',
    )


def _add_compat_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's flags that mean nothing here or name a missing feature (``serve``, ``run-batch``)."""
    for flag, (kwargs, why) in {**NO_EFFECT_FLAGS, **MISSING_FEATURE_FLAGS}.items():
        group.add_argument(flag, default=None, help=why, **kwargs)


def _add_config_arg(parser: argparse.ArgumentParser) -> None:
    """(``with_config_file`` reads it before the parser does.)"""
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="A YAML file of these flags (vLLM's), read first: the command "
                        "line's own flags win.")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omniserve",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    serve = sub.add_parser(
        "serve", formatter_class=fmt, help="Serve a model over an OpenAI-compatible HTTP API."
    )
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Checkpoint dir. None: a tiny built-in model, built on first use.",
    )
    serve.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help="The checkpoint dir as a flag (vLLM's older spelling of the positional).",
    )
    _add_config_arg(serve)
    add_server_args(serve.add_argument_group("server"))
    _add_serving_args(serve.add_argument_group("serving"))
    EngineArgs.add_cli_args(serve)
    compat = serve.add_argument_group(
        "vLLM compatibility",
        "vLLM's flags that mean nothing here (accepted, logged) or name a "
        "feature omniserve lacks (start-up fails naming it).",
    )
    _add_compat_args(compat)
    serve.set_defaults(func=_cmd_serve, check_flags=_check_serve_flags)

    for name, help_text in (
        ("chat", "Chat with a running server (vLLM's `vllm chat`): --quick, or lines of stdin."),
        ("complete", "Complete prompts on a running server (vLLM's `vllm complete`)."),
    ):
        client = sub.add_parser(name, formatter_class=fmt, help=help_text)
        add_client_args(client)
        if name == "chat":
            client.add_argument("--system-prompt", default=None, help="A system message first.")
        client.set_defaults(func=chat if name == "chat" else complete)

    batch = sub.add_parser(
        "run-batch",
        formatter_class=fmt,
        help="Answer an OpenAI batch file (JSONL: custom_id, method, url, body a line) with "
        "the server's routes, in this process, into a JSONL file of batch output lines.",
    )
    batch.add_argument(
        "-i", "--input-file", required=True, help="The batch file to answer (path or http(s) URL)."
    )
    batch.add_argument(
        "-o", "--output-file", required=True, help="Where the answers go (path, or URL to PUT)."
    )
    batch.add_argument("--output-tmp-dir", default=None, help="Where an upload is staged.")
    _add_config_arg(batch)
    batch.add_argument("--model", default=None, help="Checkpoint dir. None: a tiny built-in model.")
    _add_serving_args(batch.add_argument_group("serving"))
    EngineArgs.add_cli_args(batch)
    _add_compat_args(batch.add_argument_group("vLLM compatibility"))
    batch.set_defaults(func=_cmd_run_batch, check_flags=_check_serve_flags)

    tiny = sub.add_parser(
        "make-tiny", formatter_class=fmt, help="Build a tiny Hugging Face checkpoint offline."
    )
    tiny.add_argument("architecture", help="e.g. Qwen3ForCausalLM")
    tiny.add_argument("--out", default=None, help="Output dir (default: the cache dir).")
    tiny.add_argument("--size", default="tiny", choices=["tiny", "bench"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--overrides", default=None, help="JSON of config fields to override.")
    tiny.add_argument(
        "--as-architecture",
        default=None,
        metavar="NAME",
        help="Name NAME in config.json 'architectures' (a plugin's own "
        "architecture) instead of the family's; writes a copy.",
    )
    tiny.set_defaults(func=_cmd_make_tiny)

    gen = sub.add_parser("generate", formatter_class=fmt, help="Generate offline for prompts.")
    gen.add_argument(
        "model", nargs="?", default=None, help="Checkpoint dir (default: a tiny built-in model)."
    )
    gen.add_argument("--prompt", action="append", help="A prompt (repeatable).")
    gen.add_argument("--chat", action="store_true", help="Wrap prompts in the chat template.")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_cmd_generate)

    _add_plugin_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = with_config_file(list(sys.argv[1:] if argv is None else argv), parser)
    except ValueError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    if hasattr(args, "check_flags"):
        args.check_flags(parser, args)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"omniserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`kvlab serve`: the OpenAI-compatible server from the command line, with vLLM's flag spellings.

    kvlab serve                                   # the embedded model on http://127.0.0.1:8000
    kvlab serve Qwen/Qwen2.5-0.5B-Instruct --dtype float16 --max-num-seqs 64 --kv-cache-dtype fp8
    kvlab serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
    python -m kvlab.serve --port 8001             # the same, without the console script
    kvlab proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200   # disaggregated prefill/decode
    kvlab router --replica http://127.0.0.1:8101 --kv-events tcp://127.0.0.1:5557 ...  # cache-aware routing
    kvlab replicas --num-replicas 3 --policy kv-cost  # three replicas and the router, until Ctrl-C

The engine's flags are not written here: each is derived from its knob in kvlab.engine.config
(EngineConfig.add_cli_args), so `kvlab serve --help` and LLM(...) accept the same settings with the same
defaults and checks. Only the server's own flags (host, port, the served name, the log level) are below.
"""

import argparse
import sys

from kvlab.engine.config import EngineConfig, parse_bytes, parse_json_object

__all__ = ["build_server", "main", "parse_bytes", "parse_json_object", "serve_parser"]


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `kvlab serve`: the engine's knobs, then the server's own."""
    EngineConfig.add_cli_args(parser)
    server = parser.add_argument_group("server", "where and how the HTTP server listens")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the name(s) clients send as 'model' (vLLM's flag): answers carry the first; "
                             "default the model argument, or kvlab-embedded")
    server.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def build_server(args: argparse.Namespace):
    """(FastAPI app, AsyncLLM) for parsed `kvlab serve` arguments."""
    from kvlab.engine.async_llm import AsyncLLM
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.entrypoints.openai.api_server import build_app
    from kvlab.model.loader import load_model

    config = EngineConfig.from_cli_args(args)  # every knob checked before the model loads
    model_config = config.model_config
    model, tokenizer = load_model(args.model, dtype=model_config.torch_dtype, device=model_config.device)
    async_llm = AsyncLLM(LLMEngine(model, tokenizer, config))
    names = args.served_model_name or [args.model or "kvlab-embedded"]
    return build_app(async_llm, names, tokenizer), async_llm


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="kvlab", description="kvlab's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser(commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))
    from kvlab.entrypoints.disagg_proxy import proxy_parser

    proxy_parser(commands.add_parser("proxy", help="one OpenAI endpoint in front of a prefill and a decode server "
                                                   "(disaggregated prefill/decode)"))
    from kvlab.entrypoints.replicas import replicas_parser
    from kvlab.entrypoints.router import router_parser

    router_parser(commands.add_parser("router", help="one OpenAI endpoint in front of several replicas, placing "
                                                     "each request by their KV caches and loads"))
    replicas_parser(commands.add_parser("replicas", help="start N replicas and the router in front, until Ctrl-C"))
    args = parser.parse_args(argv)
    if args.command == "router":
        from kvlab.entrypoints.router import run_router

        run_router(args, parser)
    if args.command == "replicas":
        from kvlab.entrypoints.replicas import run_replicas

        run_replicas(args, parser)
    if args.command == "proxy":
        import uvicorn

        from kvlab.entrypoints.disagg_proxy import build_proxy_app

        try:
            app = build_proxy_app(args.prefill, args.decode, args.fallback_local_prefill, args.prefill_timeout_s,
                                  args.decode_timeout_s)
        except ValueError as err:
            parser.exit(2, f"kvlab proxy: {err}\n")
        print(f"kvlab proxy: prefill {args.prefill}, decode {args.decode}, on http://{args.host}:{args.port}",
              file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    if args.command == "serve":
        import uvicorn

        try:
            app, _ = build_server(args)
        except (ValueError, FileNotFoundError) as err:
            parser.exit(2, f"kvlab serve: {err}\n")
        print(f"kvlab serve: {app.title} on http://{args.host}:{args.port} (OpenAI API under /v1)", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()

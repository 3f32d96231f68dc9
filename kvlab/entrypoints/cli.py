"""`kvlab serve`: the OpenAI-compatible server from the command line, with `vllm serve`'s flag spellings.

    kvlab serve                                   # the embedded model on http://127.0.0.1:8000
    kvlab serve Qwen/Qwen2.5-0.5B-Instruct --dtype float16 --max-num-seqs 64 --kv-cache-dtype fp8
    kvlab serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
    python -m kvlab.serve --port 8001             # the same, without the console script
"""

import argparse
import json
import re
import sys

UNITS = {"": 1, "k": 2**10, "ki": 2**10, "kib": 2**10, "m": 2**20, "mi": 2**20, "mib": 2**20,
         "g": 2**30, "gi": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """A byte count: 536870912, 512MiB, 512M, 1GiB."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (give e.g. 536870912, 512MiB or 1GiB)")
    return int(match.group(1)) * UNITS[match.group(2).lower()]


def parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        example = '{"method": "ngram", "num_speculative_tokens": 3}'
        raise argparse.ArgumentTypeError(f"give a JSON object, e.g. '{example}'")
    return value


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default=None,
                        help="a Hugging Face id or a local folder (default: the course's embedded model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the name clients send as 'model'")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                        help="the pool as a byte budget instead of --num-blocks (e.g. 512MiB)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_e4m3"])
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    parser.add_argument("--speculative-config", type=parse_json_object, default=None,
                        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def build_server(args: argparse.Namespace):
    """(FastAPI app, AsyncLLM) for parsed `kvlab serve` arguments."""
    import torch

    from kvlab.engine.async_llm import AsyncLLM
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.entrypoints.openai.api_server import build_app
    from kvlab.model.loader import load_model

    dtype = {"auto": torch.float32 if args.model is None else None, "float32": torch.float32,
             "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    model, tokenizer = load_model(args.model, dtype=dtype or torch.float32, device=args.device)
    engine = LLMEngine(model, tokenizer, block_size=args.block_size, num_blocks=args.num_blocks,
                       kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                       enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                       preemption_mode=args.preemption_mode, speculative_config=args.speculative_config,
                       seed=args.seed)
    name = args.served_model_name or (args.model or "kvlab-embedded")
    async_llm = AsyncLLM(engine)
    return build_app(async_llm, name, tokenizer), async_llm


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="kvlab", description="kvlab's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser(commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))
    args = parser.parse_args(argv)
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

"""`iterserve generate`: offline generation from the command line (no server).

    iterserve generate "The capital of France is"
    iterserve generate --chat "Write a haiku about batching" --max-tokens 64 --temperature 0.7
"""

from __future__ import annotations

import argparse
import logging
import sys

from iterserve.engine.config import DEFAULT_MODEL, ConfigError
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a .gguf file, a HuggingFace directory, or the alias {DEFAULT_MODEL} (default)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--system", help="system message for --chat")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=-1)
    sampling.add_argument("--seed", type=int, help="per-request seed for reproducible sampling")
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    engine.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    engine.add_argument("--max-model-len", type=int, help="context length (default: the model's, at most 2048)")
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--kv-cache-memory", default="512MiB", help="KV pool size, e.g. 512MiB")
    parser.add_argument("--verbose", action="store_true", help="log engine start-up details")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from iterserve.engine.llm import LLM
    from iterserve.engine.model.loader import ModelLoadError

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  kv_cache_memory=args.kv_cache_memory)
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            conversations = [system + [{"role": "user", "content": p}] for p in args.prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except (ConfigError, InvalidRequestError, ModelLoadError, ValueError) as error:
        print(f"iterserve generate: {error}", file=sys.stderr)
        return 1 if isinstance(error, ModelLoadError) else 2
    for index, (prompt, output) in enumerate(zip(args.prompts, outputs, strict=True)):
        if index:
            print()
        text = output.outputs[0].text
        print(text if args.chat else prompt + text)
    return 0

"""Commands that use a trained model: ``diloco generate`` and ``diloco export``.

    diloco generate RUN_DIR_OR_CHECKPOINT --prompt "def main(" [--max-new-tokens 200] [--temperature 0.8]
                    [--top-k 40] [--top-p 0.95] [--seed 0] [--no-cache] [--device cuda]
    diloco export --format hf RUN_DIR_OR_CHECKPOINT OUT_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from diloco.checkpoint import CheckpointError
from diloco.command import run_command
from diloco.config import ConfigError
from diloco.generate import GenerationError, Sampling, StreamDecoder, encode, generate


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError([f"--device {name}: this machine has no CUDA device; use --device cpu"])
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError([f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N"]) from None


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None and args.prompt_file is not None:
        raise ConfigError(["pass either --prompt or --prompt-file, not both"])
    if args.prompt_file is not None:
        try:
            lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError([f"cannot read --prompt-file {args.prompt_file} ({e}); pass a UTF-8 text file"]) from None
        prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
        if not prompts:
            raise ConfigError([f"--prompt-file {args.prompt_file} has no non-empty line; put one prompt per line"])
        return prompts
    return [(args.prompt if args.prompt is not None else "\n").replace("\\n", "\n")]


def generate_main(argv: list[str]) -> int:
    """``diloco generate``: continue prompts with a trained model, streaming the text; tokens/s at the end."""
    parser = argparse.ArgumentParser(prog="diloco generate", description=generate_main.__doc__)
    parser.add_argument("model", help="a checkpoint (ckpt-*.pt), a run or checkpoint directory (its newest "
                                      "checkpoint), or a folder written by `diloco export`")
    parser.add_argument("--prompt", help="text to continue (\\n for a newline; default: a newline)")
    parser.add_argument("--prompt-file", help="a file with one prompt per line")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every token")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    args = parser.parse_args(argv)

    def body() -> int:
        from diloco.export import load_trained

        if args.max_new_tokens < 1:
            raise ConfigError([f"--max-new-tokens {args.max_new_tokens} must be at least 1"])
        prompts = _prompts(args)
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        sampling.check()
        device = _device(args.device)
        model, cfg, source = load_trained(args.model)
        model.to(device)
        print(f"[model {cfg.dim}d x {cfg.n_layers} layers from {source}, {device}, "
              f"{'KV cache' if not args.no_cache else 'no cache'}]", file=sys.stderr, flush=True)
        tokens = seconds = 0.0
        for prompt in prompts:
            stream = StreamDecoder()
            sys.stdout.write(prompt)
            out = generate(model, encode(prompt), args.max_new_tokens, sampling, use_cache=not args.no_cache,
                           on_token=lambda t: (sys.stdout.write(stream.push(t)), sys.stdout.flush()))
            sys.stdout.write(stream.flush() + "\n")
            sys.stdout.flush()
            if out.stopped_at_context:
                print(f"[stopped at the model's context of {cfg.seq_len} tokens]", file=sys.stderr)
            tokens += len(out.tokens)
            seconds += out.seconds
        print(f"[{int(tokens)} tokens in {seconds:.2f} s: {tokens / max(seconds, 1e-9):.1f} tokens/s]",
              file=sys.stderr, flush=True)
        return 0

    return run_command(body, (CheckpointError, GenerationError))


def export_main(argv: list[str]) -> int:
    """``diloco export --format hf``: θ_global as a Hugging Face Llama folder (config, safetensors, tokenizer)."""
    parser = argparse.ArgumentParser(prog="diloco export", description=export_main.__doc__)
    parser.add_argument("model", help="a checkpoint (ckpt-*.pt) or a run or checkpoint directory")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--format", default="hf", help="hf (the only format so far)")
    args = parser.parse_args(argv)

    def body() -> int:
        from diloco.export import export_hf, load_trained

        if args.format != "hf":
            raise ConfigError([f"--format {args.format!r} is not supported; use --format hf"])
        model, cfg, source = load_trained(args.model)
        out = export_hf(dict(model.named_parameters()), cfg, args.out)
        print(f"exported {source} to {out} (load it with transformers.AutoModelForCausalLM.from_pretrained"
              f"({str(out)!r}) and AutoTokenizer)")
        return 0

    return run_command(body, (CheckpointError,))


COMMANDS = {"generate": generate_main, "export": export_main}

"""Commands that use a trained model: ``diloco generate``, ``diloco eval`` and ``diloco export``.

    diloco generate RUN_DIR_OR_CHECKPOINT --prompt "def main(" [--max-new-tokens 200] [--temperature 0.8]
                    [--top-k 40] [--top-p 0.95] [--seed 0] [--no-cache] [--device cuda]
    diloco eval RUN_DIR_OR_CHECKPOINT [--data.path TEXT] [--split heldout|all] [--per-document]
    diloco export --format hf RUN_DIR_OR_CHECKPOINT OUT_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from diloco.command import ArgumentParser, run_command
from diloco.config import ConfigError, DataConfig
from diloco.data.corpus import DataError
from diloco.files import OutputError, output_folder
from diloco.inference.generate import GenerationError, Sampling, generate
from diloco.model.checkpoint import CheckpointError


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
    parser = ArgumentParser(prog="diloco generate", description=generate_main.__doc__)
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
    parser.add_argument("--parallel.tp", dest="tp", type=int, default=1,
                        help="tensor-parallel degree (launch tp*pp processes with torchrun, as for training)")
    parser.add_argument("--parallel.pp", dest="pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--parallel.layers_per_stage", dest="layers_per_stage", default="",
                        help="layers per stage, e.g. 3,1 (default: balanced by parameters)")
    args = parser.parse_args(argv)

    def body() -> int:
        from diloco.inference.export import load_trained

        if args.max_new_tokens < 1:
            raise ConfigError([f"--max-new-tokens {args.max_new_tokens} must be at least 1"])
        prompts = _prompts(args)
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        sampling.check()
        device = _device(args.device)
        model, cfg, source, tokenizer = load_trained(args.model)
        run, speaks, shape = _runner(model, args, device)
        if speaks:
            print(f"[model {cfg.dim}d x {cfg.n_layers} layers from {source}, {device}{shape}, "
                  f"{'KV cache' if not args.no_cache else 'no cache'}]", file=sys.stderr, flush=True)
        write = sys.stdout.write if speaks else (lambda _: 0)
        tokens = seconds = 0.0
        for prompt in prompts:
            stream = tokenizer.stream()
            write(prompt)
            out = run(tokenizer.encode(prompt), args.max_new_tokens, sampling, use_cache=not args.no_cache,
                      on_token=lambda t: (write(stream.push(t)), sys.stdout.flush()))
            write(stream.flush() + "\n")
            sys.stdout.flush()
            if out.stopped_at_context and speaks:
                print(f"[stopped at the model's context of {cfg.seq_len} tokens]", file=sys.stderr)
            tokens += len(out.tokens)
            seconds += out.seconds
        if speaks:
            print(f"[{int(tokens)} tokens in {seconds:.2f} s: {tokens / max(seconds, 1e-9):.1f} tokens/s]",
                  file=sys.stderr, flush=True)
        from pipeline.mesh import destroy_island

        destroy_island()
        return 0

    return run_command(body, (CheckpointError, GenerationError))


def _runner(model, args: argparse.Namespace, device: torch.device):
    """(generate function, whether this process prints, a note on the island shape): one process, or a
    tp×pp island of torchrun processes built from the same pipeline functions as training."""
    import os

    from pipeline import ParallelSettings

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp * args.pp == 1 and world == 1:
        model.to(device)
        return (lambda *a, **k: generate(model, *a, **k)), True, ""
    from diloco.inference.generate_parallel import (
        IslandGenerator,
        check_island,
        start_island,
    )

    try:
        layers = [int(n) for n in args.layers_per_stage.split(",") if n.strip()]
    except ValueError:
        raise ConfigError([f"--parallel.layers_per_stage {args.layers_per_stage!r} must be numbers like 3,1"]) from None
    # one sequence walks the stages in turn: no schedule, so microbatches only satisfy the split's checks
    settings = ParallelSettings(tp=args.tp, pp=args.pp, microbatches=max(1, args.pp), layers_per_stage=layers)
    problems = check_island(model, settings)
    if world != args.tp * args.pp:
        problems.append(f"--parallel.tp {args.tp} x --parallel.pp {args.pp} is {args.tp * args.pp} processes but "
                        f"{world} were launched; run torchrun --nproc-per-node {args.tp * args.pp} -m diloco.cli "
                        f"generate ...")
    if problems:
        raise ConfigError(problems)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    island = IslandGenerator(start_island(model, settings, device), model.cfg)
    return island.generate, int(os.environ.get("RANK", "0")) == 0, f", tp={args.tp} x pp={args.pp}"


def export_main(argv: list[str]) -> int:
    """``diloco export --format hf``: θ_global as a Hugging Face Llama folder (config, safetensors, tokenizer)."""
    parser = ArgumentParser(prog="diloco export", description=export_main.__doc__)
    parser.add_argument("model", help="a checkpoint (ckpt-*.pt) or a run or checkpoint directory")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--format", default="hf", help="hf (the only format so far)")
    args = parser.parse_args(argv)

    def body() -> int:
        from safetensors import SafetensorError

        from diloco.inference.export import load_trained
        from diloco.model.hf import export_hf

        if args.format != "hf":
            raise ConfigError([f"--format {args.format!r} is not supported; use --format hf"])
        model, cfg, source, tokenizer = load_trained(args.model)
        with output_folder(args.out, marker="config.json") as folder:  # an earlier export there is replaced whole
            try:
                export_hf(dict(model.named_parameters()), cfg, folder, tokenizer)
            except SafetensorError as e:  # safetensors' own writer reports a full disk as this, not OSError
                raise OutputError(f"cannot write {args.out}: {e}; free some space there or export elsewhere") from None
        out = Path(args.out)
        print(f"exported {source} to {out} (load it with transformers.AutoModelForCausalLM.from_pretrained"
              f"({str(out)!r}) and AutoTokenizer)")
        return 0

    return run_command(body, (CheckpointError,))


def eval_main(argv: list[str]) -> int:
    """``diloco eval``: held-out loss, perplexity and bits per byte of a trained model on any text."""
    parser = ArgumentParser(prog="diloco eval", description=eval_main.__doc__)
    parser.add_argument("model", help="a checkpoint (ckpt-*.pt), a run or checkpoint directory, or an exported folder")
    defaults = DataConfig()
    parser.add_argument("--data.path", dest="path", default=defaults.path,
                        help="the text: stdlib, a file, a directory, a glob or hf:NAME[:CONFIG] (as for training)")
    parser.add_argument("--data.heldout_fraction", dest="heldout_fraction", type=float,
                        default=defaults.heldout_fraction)
    parser.add_argument("--data.max_bytes", dest="max_bytes", type=int, default=0)
    parser.add_argument("--data.hf_text_field", dest="hf_text_field", default=defaults.hf_text_field)
    parser.add_argument("--split", default="heldout", help="heldout (the documents training left out) or all")
    parser.add_argument("--per-document", action="store_true", help="also print every document's loss")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)

    def body() -> int:
        from diloco.inference.evaluate import evaluate, heldout_documents
        from diloco.inference.export import load_trained

        if args.batch_size < 1:
            raise ConfigError([f"--batch-size {args.batch_size} must be at least 1"])
        device = _device(args.device)
        model, _, source, tokenizer = load_trained(args.model)
        data = DataConfig(path=args.path, heldout_fraction=args.heldout_fraction, max_bytes=args.max_bytes,
                          hf_text_field=args.hf_text_field)
        docs, what = heldout_documents(data, args.split)
        print(f"[evaluating {source} on {len(docs)} {args.split} document(s) of {what}]", file=sys.stderr, flush=True)
        result = evaluate(model.to(device), docs, args.batch_size, tokenizer=tokenizer)
        if args.per_document:
            for name, loss, count in sorted(result.per_document, key=lambda d: d[1]):
                print(f"{loss:8.4f}  {count:>9}  {name}")
        print(f"loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}, {result.bits_per_byte:.4f} "
              f"bits/byte over {result.tokens} tokens ({result.bytes} bytes) of {len(docs)} document(s)")
        return 0

    return run_command(body, (CheckpointError, DataError))


COMMANDS = {"generate": generate_main, "export": export_main, "eval": eval_main}

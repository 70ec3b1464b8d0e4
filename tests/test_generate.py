"""Using what was trained: generation with and without the KV cache, export to Hugging Face and back."""

from __future__ import annotations

import json

import pytest
import torch

from diloco.cli import main
from diloco.data.tokenizer import Tokenizer
from diloco.inference.export import load_trained
from diloco.inference.generate import GenerationError, Sampling, generate
from diloco.model.checkpoint import CheckpointError
from diloco.model.hf import export_hf
from diloco.model.weights import load_parameters
from tests.conftest import tiny_config

PROMPTS = ["def __init__(self", "import os\n", "    return "]
BYTES = Tokenizer()
encode, decode = BYTES.encode, BYTES.decode


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for 60 steps on the standard library's source, as a run directory."""
    from diloco.engine.island import train

    run_dir = tmp_path_factory.mktemp("run")
    train(tiny_config(run_dir, **{"diloco.inner_steps": 20, "checkpoint.every": 1}))
    return run_dir


def test_greedy_tokens_are_the_same_with_and_without_the_cache(trained):
    model, cfg, source, _ = load_trained(trained)
    assert source.name == "ckpt-000003.pt"
    for prompt in PROMPTS:
        cached = generate(model, encode(prompt), 12, use_cache=True)
        full = generate(model, encode(prompt), 12, use_cache=False)
        assert cached.tokens == full.tokens
        assert len(cached.tokens) == 12 and not cached.stopped_at_context
    # past the context (32 tokens for tiny) the generation stops and says so
    out = generate(model, encode("x" * 20), 50)
    assert len(out.tokens) == cfg.seq_len - 20 and out.stopped_at_context


def test_sampling_is_repeatable_by_seed_and_respects_top_k(trained):
    model, _, _, _ = load_trained(trained)
    prompt = encode(PROMPTS[0])
    a = generate(model, prompt, 16, Sampling(temperature=1.0, seed=3)).tokens
    assert a == generate(model, prompt, 16, Sampling(temperature=1.0, seed=3)).tokens
    assert a != generate(model, prompt, 16, Sampling(temperature=1.0, seed=4)).tokens
    greedy = generate(model, prompt, 16).tokens
    assert generate(model, prompt, 16, Sampling(temperature=1.0, top_k=1, seed=5)).tokens == greedy
    assert generate(model, prompt, 16, Sampling(temperature=1.0, top_p=1e-6, seed=6)).tokens == greedy


def test_bad_requests_say_what_to_change(trained, capsys):
    model, cfg, _, _ = load_trained(trained)
    with pytest.raises(GenerationError, match="context is 32"):
        generate(model, encode("y" * cfg.seq_len), 5)
    for bad in (Sampling(temperature=float("nan")), Sampling(top_p=0.0), Sampling(top_k=-1)):
        with pytest.raises(GenerationError):
            generate(model, encode("a"), 2, bad)
    assert main(["generate", str(trained / "nothing-here")]) == 1
    assert main(["generate", str(trained), "--prompt", "z" * 40]) == 1
    assert main(["export", "--format", "onnx", str(trained), str(trained / "out")]) == 2
    err = capsys.readouterr().err
    assert sum(line.startswith("error: ") for line in err.splitlines()) == 3 and "Traceback" not in err, err


def test_generate_command_streams_text_and_reports_speed(trained, capsys):
    assert main(["generate", str(trained), "--prompt", "def ", "--max-new-tokens", "12", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    model, _, _, _ = load_trained(trained)
    assert out == "def " + decode(generate(model, encode("def "), 12).tokens) + "\n"
    assert "tokens/s" in err


def test_simulate_prints_a_sample_at_the_end(trained):
    from diloco.launch.simulate import format_summary, last_sample

    sample = last_sample(trained)
    assert sample["outer_step"] == 3 and sample["prompt"] and sample["continuation"]
    island = json.loads((trained / "summary.json").read_text())
    text = format_summary({"islands": [island], "theta_global_max_abs_diff": 0.0, "wall_seconds": 1.0,
                           "sample": sample})
    assert "after round 3" in text and repr(sample["continuation"]) in text


def test_eval_matches_the_island_loss_definition_and_lists_documents(trained, tmp_path, capsys):
    from diloco.config import DataConfig
    from diloco.inference.evaluate import document_loss, evaluate, heldout_documents
    from diloco.model.transformer import lm_loss

    model, cfg, _, _ = load_trained(trained)
    text = (tmp_path / "a.txt")
    text.write_text("def f(x):\n    return x + 1\n" * 8)
    (tmp_path / "b.txt").write_text("import sys\nprint(sys.argv)\n" * 5)
    data = text.read_bytes()[: 2 * cfg.seq_len + 1]  # exactly two windows: the same as the training loss
    loss, count = document_loss(model, data, batch_size=1)
    rows = torch.tensor(list(data), dtype=torch.long).view(1, -1)
    x = torch.stack([rows[0, :cfg.seq_len], rows[0, cfg.seq_len:2 * cfg.seq_len]])
    y = torch.stack([rows[0, 1:cfg.seq_len + 1], rows[0, cfg.seq_len + 1:]])
    with torch.no_grad():
        assert count == 2 * cfg.seq_len and abs(loss / count - lm_loss(model(x), y).item()) < 1e-5
    docs, _ = heldout_documents(DataConfig(path=str(tmp_path / "*.txt")), "all")
    result = evaluate(model, docs, progress=False)
    assert len(result.per_document) == 2 and result.tokens == sum(len(d) - 1 for _, d in docs)
    assert main(["eval", str(trained), "--data.path", str(tmp_path / "*.txt"), "--split", "all",
                 "--per-document"]) == 0
    out, err = capsys.readouterr()
    assert "a.txt" in out and "b.txt" in out and f"loss {result.loss:.4f} nats/token" in out
    assert "\r" not in err and "documents=" not in err, "a progress bar in a log (stderr is not a terminal here)"
    assert main(["eval", str(trained), "--data.path", str(tmp_path / "missing.txt")]) == 1
    assert main(["eval", str(trained), "--split", "train"]) == 1
    assert capsys.readouterr().err.count("error: ") == 2


def test_a_tp2_pp2_gloo_island_generates_the_same_text(trained, tmp_path):
    """The training layout mirrored for inference: 4 torchrun processes, heads and MLP sharded over tp=2,
    blocks over pp=2, each stage keeping its part of the cache; greedy text equal to one process's."""
    import os
    import subprocess
    import sys

    model, _, _, _ = load_trained(trained)
    want = "def " + decode(generate(model, encode("def "), 20).tokens) + "\n"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "diloco.cli",
           "generate", str(trained), "--prompt", "def ", "--max-new-tokens", "20", "--device", "cpu",
           "--parallel.tp", "2", "--parallel.pp", "2"]
    for extra in ([], ["--no-cache"]):
        done = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout == want, (done.stdout, want)
        assert "tp=2 x pp=2" in done.stderr and "tokens/s" in done.stderr
    # a tp degree that does not divide the heads: one line per rank, exit != 0
    bad = subprocess.run(cmd[:5] + ["3"] + cmd[6:-4] + ["--parallel.tp", "3"], capture_output=True, text=True,
                         timeout=240, env=env)
    assert bad.returncode != 0 and "must be divisible by --parallel.tp (3)" in bad.stderr, bad.stderr[-2000:]
    assert "/diloco/" not in bad.stderr  # torchrun reports the failed ranks, but no frame of ours: no traceback


def test_stream_decoder_holds_back_incomplete_characters():
    stream = BYTES.stream()
    pieces = [stream.push(b) for b in "é—x".encode()]
    assert "".join(pieces) == "é—x" and pieces[0] == "" and pieces[1] == "é"


def test_export_loads_in_transformers_with_the_same_logits_and_comes_back_lossless(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, cfg, _, _ = load_trained(trained)
    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", str(trained), str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "class Foo:\n    def bär(self):\n"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode()) and tok.decode(ids) == text
    from diloco.data.corpus import load_corpus

    heldout = load_corpus(tiny_config(tmp_path).data).heldout[: 4 * cfg.seq_len]
    batch = torch.from_numpy(heldout.astype("int64")).view(4, cfg.seq_len)
    with torch.no_grad():
        ours, theirs = model(batch), hf(batch).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    # and back: init_from accepts the folder, and exporting it again gives the same tensors
    params, _ = load_parameters(out)
    assert all(torch.equal(params[n], p) for n, p in model.named_parameters())
    again = export_hf(params, cfg, tmp_path / "again")
    from safetensors.torch import load_file

    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((again / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    with pytest.raises(CheckpointError, match="not a folder"):
        export_hf(params, cfg, out / "model.safetensors")

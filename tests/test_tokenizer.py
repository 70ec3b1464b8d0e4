"""Subword tokens: a byte-level BPE trained on real text, islands that train on it, and a model that carries it
into exports, generation and evaluation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diloco.cli import main
from diloco.config import DataConfig, ModelConfig
from diloco.data.corpus import DataError, documents, load_corpus
from diloco.data.tokenizer import Tokenizer, fit_vocabulary, train_bpe
from diloco.engine.metrics import read_metrics
from diloco.inference.export import load_trained
from diloco.inference.generate import Sampling, generate
from tests.conftest import tiny_config

TEXT = "def naïve(self, x):\n    return {'ß': x ** 2}  # ünïcode — 漢字 🙂\n\n"


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    assert main(["tokenizer", "train", "--data.max_bytes", "1500000", "--tokenizer.vocab_size", "600",
                 "--out", str(out)]) == 0
    return out


def test_a_trained_bpe_round_trips_any_text_and_is_shorter_than_bytes(bpe_file):
    tok = Tokenizer.load(str(bpe_file))
    assert not tok.is_bytes and tok.vocab_size == 600 and tok.eos_id is not None
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and max(ids) < 600
    source = "".join(d.decode() for _, d in documents(DataConfig(max_bytes=200_000))[0])
    assert len(tok.encode(source)) < 0.6 * len(source.encode()), "no compression: the merges were not learnt"
    stream = tok.stream()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == TEXT
    joined = tok.encode_documents([b"first", b"second"])
    assert list(joined) == tok.encode("first") + [tok.eos_id] + tok.encode("second")
    # the same file from a folder, and bytes recognised whatever way they are named
    assert Tokenizer.load(str(bpe_file.parent)).sha256 == tok.sha256
    assert Tokenizer.from_json(None).is_bytes and Tokenizer().encode(TEXT) == list(TEXT.encode())


def test_bytes_saved_as_json_read_back_as_bytes(tmp_path):
    Tokenizer().save(tmp_path / "tokenizer.json")
    assert Tokenizer.load(str(tmp_path)).is_bytes


def test_bad_tokenizers_and_vocabularies_are_one_clear_error(tmp_path, capsys):
    with pytest.raises(DataError, match="no such tokenizer file"):
        Tokenizer.load(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="is not a tokenizers JSON"):
        Tokenizer.load(str(tmp_path / "bad.json"))
    small = Tokenizer.from_json(train_bpe(documents(DataConfig(max_bytes=100_000))[0], 300).json_text)
    model = ModelConfig(preset="tiny")
    fit_vocabulary(model, small)
    assert model.vocab_size == 300
    with pytest.raises(DataError, match="--model.vocab_size 256 is smaller than the 300 tokens"):
        fit_vocabulary(ModelConfig(preset="tiny", vocab_size=256), small)
    assert main(["tokenizer", "train", "--tokenizer.vocab_size", "100", "--out", str(tmp_path / "t.json")]) == 1
    assert "must be at least 257" in capsys.readouterr().err


def test_an_island_trains_on_bpe_tokens_and_its_export_generates_the_same_ids_in_transformers(bpe_file, tmp_path):
    transformers = pytest.importorskip("transformers")
    from diloco.engine.island import train

    cfg = tiny_config(tmp_path / "run", **{"data.tokenizer": str(bpe_file), "diloco.outer_steps": 2,
                                           "checkpoint.every": 1})
    summary = train(cfg)
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/bits_per_byte" in r]
    corpus = load_corpus(cfg.data, Tokenizer.load(str(bpe_file)))
    bytes_per_token = corpus.heldout_bytes_per_token
    assert bytes_per_token > 1.5, "the held-out text is not in subword tokens"
    assert evals and all(r["eval/bits_per_byte"] == pytest.approx(r["eval/loss"] / math.log(2) / bytes_per_token)
                         for r in evals)

    model, model_cfg, _, tok = load_trained(tmp_path / "run")
    assert model_cfg.vocab_size == 600 and tok.sha256 == Tokenizer.load(str(bpe_file)).sha256
    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", str(tmp_path / "run"), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 600
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = "def main(self):\n    "
    ids = tok.encode(prompt)
    assert hf_tok(prompt, add_special_tokens=False)["input_ids"] == ids
    ours = generate(model, ids, 12, Sampling(temperature=0.0)).tokens
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert theirs.tolist() == ours
    assert hf_tok.decode(theirs) == tok.decode(ours)

"""Prepared corpora: tokenized once by `diloco data prepare`, memory-mapped by every island."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from diloco.cli import main
from diloco.config import DataConfig
from diloco.data.batches import ShardedBatches
from diloco.data.corpus import DataError, documents, load_corpus
from diloco.data.prepared import prepare
from diloco.data.tokenizer import Tokenizer, train_bpe
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(documents(DataConfig(max_bytes=200_000))[0], 320)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_a_prepared_folder_holds_the_streams_training_would_build(kind, bpe, tmp_path):
    tokenizer = Tokenizer() if kind == "bytes" else bpe
    cfg = DataConfig(max_bytes=1_500_000)
    raw = load_corpus(cfg, tokenizer)
    docs, what = documents(cfg)
    manifest = prepare(docs, tokenizer, tmp_path / "prep", cfg.heldout_fraction, what)
    prepared = load_corpus(DataConfig(path=str(tmp_path / "prep")))
    assert isinstance(prepared.train, np.memmap) and prepared.train.dtype == (np.uint8 if kind == "bytes" else np.uint16)
    assert np.array_equal(prepared.train, raw.train) and np.array_equal(prepared.heldout, raw.heldout)
    assert prepared.heldout_bytes_per_token == pytest.approx(raw.heldout_bytes_per_token)
    assert manifest["tokenizer_sha256"] == tokenizer.sha256
    assert Tokenizer.for_data(DataConfig(path=str(tmp_path / "prep"))).sha256 == tokenizer.sha256


def test_islands_take_disjoint_windows_of_a_prepared_folder_and_resume_exactly(tmp_path):
    assert main(["data", "prepare", "--data.max_bytes", "600000", "--out", str(tmp_path / "prep")]) == 0
    corpus = load_corpus(DataConfig(path=str(tmp_path / "prep")))
    shards = [ShardedBatches(corpus.train, 32, 4, i, 2, seed=0) for i in range(2)]
    assert set(shards[0].window_range).isdisjoint(shards[1].window_range)
    first = shards[0]
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    again = ShardedBatches(corpus.train, 32, 4, 0, 2, seed=0)
    again.load_state_dict(state)
    for _ in range(3):
        x, y = first.next_batch()
        x2, y2 = again.next_batch()
        assert np.array_equal(x, x2) and np.array_equal(y, y2)


def test_an_island_trains_from_a_prepared_folder_with_its_tokenizer(bpe, tmp_path):
    from diloco.engine.island import train

    cfg = DataConfig(max_bytes=800_000)
    docs, what = documents(cfg)
    prepare(docs, bpe, tmp_path / "prep", cfg.heldout_fraction, what)
    summary = train(tiny_config(tmp_path / "run", **{"data.path": str(tmp_path / "prep"), "data.max_bytes": 0,
                                                       "diloco.outer_steps": 2}))
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    Tokenizer().save(tmp_path / "other.json")  # the byte tokenizer, as a file: not the folder's BPE
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        Tokenizer.for_data(DataConfig(path=str(tmp_path / "prep"), tokenizer=str(tmp_path / "other.json")))
    (tmp_path / "prep" / "train.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match="not the .* bytes its manifest says"):
        load_corpus(DataConfig(path=str(tmp_path / "prep")))


PEAK = """
import sys
from diloco.config import DataConfig
from diloco.data.batches import ShardedBatches
from diloco.data.corpus import load_corpus
corpus = load_corpus(DataConfig(path=sys.argv[1]))
batches = ShardedBatches(corpus.train, 128, 8, 0, 2, seed=0)
for _ in range(20):
    batches.next_batch()
status = open("/proc/self/status").read().split()
print(status[status.index("RssAnon:") + 1])
"""


def test_an_islands_memory_does_not_grow_with_a_prepared_corpus(tmp_path):
    """Its anonymous memory, that is: the pages of the mapped files it reads are clean page cache, shared and
    reclaimable (they show in RSS as the batches touch them, 64 KB around each)."""
    peaks = {}
    for name, max_bytes in (("small", 1_200_000), ("large", 12_000_000)):
        assert main(["data", "prepare", "--data.max_bytes", str(max_bytes), "--out", str(tmp_path / name)]) == 0
        out = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / name)], capture_output=True, text=True,
                             timeout=120, check=True)
        peaks[name] = int(out.stdout.split()[-1]) / 1024  # MB
    large_corpus_mb = (tmp_path / "large" / "train.bin").stat().st_size / 1e6
    assert large_corpus_mb > 10
    # read into memory, the 10x larger corpus would add ~11 MB of anonymous memory; mapped, nothing
    assert peaks["large"] - peaks["small"] < 3, peaks

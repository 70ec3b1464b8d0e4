"""Tests of the byte-level data pipeline: corpus sources, the held-out split, shards and batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.config import DataConfig
from diloco.data.batches import ShardedBatches, heldout_batches
from diloco.data.corpus import (
    SEPARATOR,
    DataError,
    HFSource,
    build_corpus,
    is_heldout,
    load_corpus,
    stdlib_documents,
)


@pytest.fixture(scope="module")
def stdlib_corpus():
    return load_corpus(DataConfig(path="stdlib"))


def test_stdlib_corpus_is_real_python_text(stdlib_corpus):
    c = stdlib_corpus
    assert c.train.dtype == np.uint8 and c.heldout.dtype == np.uint8
    assert 5e6 < c.train.size + c.heldout.size < 60e6
    assert c.num_documents > 300
    assert b"def " in c.train[:200_000].tobytes()
    assert c.heldout.size > 0
    assert "standard library" in c.description


def test_stdlib_corpus_is_deterministic(stdlib_corpus):
    again = load_corpus(DataConfig(path="stdlib"))
    assert np.array_equal(again.train, stdlib_corpus.train)
    assert np.array_equal(again.heldout, stdlib_corpus.heldout)


def test_stdlib_excludes_tests_and_site_packages():
    names = [name for name, _ in stdlib_documents()]
    assert names == sorted(names)
    for name in names:
        parts = name.split("/")
        assert not {"test", "tests", "site-packages", "dist-packages"} & set(parts), name
        assert name.endswith(".py")


def test_stdlib_heldout_disjoint_from_train_by_document():
    docs = list(stdlib_documents())
    corpus = build_corpus(docs, 0.05, "stdlib")
    heldout_names = {name for name, _ in docs if is_heldout(name, 0.05)}
    assert 0 < len(heldout_names) < len(docs)
    train_text, heldout_text = corpus.train.tobytes(), corpus.heldout.tobytes()
    expected_heldout = SEPARATOR.join(d for n, d in docs if n in heldout_names)
    expected_train = SEPARATOR.join(d for n, d in docs if n not in heldout_names)
    assert heldout_text == expected_heldout
    assert train_text == expected_train


def test_max_bytes_truncates():
    corpus = load_corpus(DataConfig(path="stdlib", max_bytes=100_000))
    total = corpus.train.size + corpus.heldout.size
    assert 100_000 <= total <= 100_000 + len(SEPARATOR) * corpus.num_documents


def test_heldout_never_empty():
    docs = [(f"doc{i}", b"x" * 10) for i in range(5)]
    assert not any(is_heldout(n, 1e-4) for n, _ in docs)
    corpus = build_corpus(docs, 1e-4, "tiny")
    assert corpus.heldout.tobytes() == b"x" * 10
    assert corpus.train.size > 0


def test_single_document_is_split_by_bytes():
    text = b"".join(b"line %d\n" % i for i in range(1000))
    corpus = build_corpus([("only.txt", text)], 0.1, "one file")
    assert corpus.train.tobytes() + corpus.heldout.tobytes() == text
    assert 0.05 * len(text) < corpus.heldout.size < 0.15 * len(text)
    assert corpus.heldout.tobytes().startswith(b"line ")


def _write_tree(root: Path) -> None:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text("alpha text\n")
    (root / "sub" / "b.md").write_text("beta text ü\n")
    (root / "sub" / "deeper" / "c.txt").write_text("gamma text\n")
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))


def _text(corpus) -> bytes:
    return corpus.train.tobytes() + corpus.heldout.tobytes()


def test_file_loading(tmp_path):
    _write_tree(tmp_path)
    corpus = load_corpus(DataConfig(path=str(tmp_path / "a.txt"), heldout_fraction=0.5))
    assert corpus.num_documents == 1
    assert _text(corpus) == b"alpha text\n"


def test_directory_loading_skips_binaries(tmp_path):
    _write_tree(tmp_path)
    corpus = load_corpus(DataConfig(path=str(tmp_path)))
    text = _text(corpus)
    assert corpus.num_documents == 3
    for word in (b"alpha", b"beta", b"gamma"):
        assert word in text
    assert b"\x00" not in text and b"caf" not in text
    assert "2 binary files skipped" in corpus.description


def test_glob_and_comma_separated_loading(tmp_path):
    _write_tree(tmp_path)
    corpus = load_corpus(DataConfig(path=str(tmp_path / "**" / "*.txt")))
    text = _text(corpus)
    assert b"alpha" in text and b"gamma" in text and b"beta" not in text
    both = load_corpus(DataConfig(path=f"{tmp_path / 'a.txt'},{tmp_path / 'sub'}"))
    assert both.num_documents == 3
    assert b"alpha" in _text(both) and b"beta" in _text(both)


def test_missing_path_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=re.escape(f"--data.path {missing} matches no file; pass a file, directory, glob")):
        load_corpus(DataConfig(path=str(missing)))
    with pytest.raises(DataError, match="matches no file"):
        load_corpus(DataConfig(path=str(tmp_path / "*.nothing")))


def test_only_binary_error(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x00\xff" * 100)
    with pytest.raises(DataError, match="holds no UTF-8 text"):
        load_corpus(DataConfig(path=str(tmp_path)))


def _windows(batches: ShardedBatches, n: int) -> list[bytes]:
    rows = []
    for _ in range(n):
        x, y = batches.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows += [bytes(r) + bytes([t]) for r, t in zip(x.to(torch.uint8).numpy(), y[:, -1].tolist())]
    return rows


def test_shards_are_disjoint_and_cover_all_windows():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=33 * 99 + 7, dtype=np.uint8)
    window = lambda i: tokens[i * 33:(i + 1) * 33].tobytes()  # noqa: E731
    shards = [ShardedBatches(tokens, 32, 3, k, 3, seed=1) for k in range(3)]
    seen = []
    for s in shards:
        epoch = _windows(s, s.num_windows // 3)
        assert len(set(epoch)) == len(epoch) == 33
        assert set(epoch) == {window(i) for i in s.window_range}
        seen.append(set(epoch))
    assert not seen[0] & seen[1] and not seen[1] & seen[2] and not seen[0] & seen[2]
    assert set().union(*seen) == {window(i) for i in range(99)}


def test_epoch_visits_every_window_once_then_reshuffles():
    tokens = np.random.default_rng(1).integers(0, 256, size=17 * 24, dtype=np.uint8)
    s = ShardedBatches(tokens, 16, 4, 0, 1, seed=5)
    first = _windows(s, 6)
    second = _windows(s, 6)
    assert len(set(first)) == 24 and set(first) == set(second) and first != second
    assert s.state_dict() == {"epoch": 2, "position": 0}
    assert s.tokens_per_batch == 64


def test_shard_order_depends_on_seed():
    tokens = np.random.default_rng(2).integers(0, 256, size=9 * 64, dtype=np.uint8)
    a, b = (ShardedBatches(tokens, 8, 4, 0, 1, seed=s).next_batch()[0] for s in (0, 1))
    again = ShardedBatches(tokens, 8, 4, 0, 1, seed=0).next_batch()[0]
    assert torch.equal(a, again) and not torch.equal(a, b)


def test_state_dict_round_trip_continues_identically():
    tokens = np.random.default_rng(3).integers(0, 256, size=17 * 50, dtype=np.uint8)
    reference = ShardedBatches(tokens, 16, 3, 1, 2, seed=7)
    for _ in range(10):
        reference.next_batch()
    state = reference.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = ShardedBatches(tokens, 16, 3, 1, 2, seed=7)
    resumed.load_state_dict(dict(state))
    for _ in range(5):
        (x1, y1), (x2, y2) = reference.next_batch(), resumed.next_batch()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_load_state_dict_rejects_impossible_position():
    tokens = np.zeros(17 * 20, dtype=np.uint8)
    s = ShardedBatches(tokens, 16, 2, 0, 1, seed=0)
    with pytest.raises(DataError, match="sharding changed"):
        s.load_state_dict({"epoch": 0, "position": 20})


def test_too_small_shard_error():
    tokens = np.zeros(129 * 40 + 5, dtype=np.uint8)
    with pytest.raises(DataError) as err:
        ShardedBatches(tokens, 128, 16, 3, 8, seed=0)
    assert str(err.value) == (
        "shard 3 of 8 holds only 5 sequences of 129 tokens but a batch needs 16; use fewer shards, "
        "a shorter --model.seq_len, a smaller --inner.batch_size or --parallel.dp, or more data")


def test_data_parallel_replicas_read_what_one_process_reads_over_accumulated_batches():
    """Replica r of dp takes the r-th batch of each dp consecutive ones, past epoch ends too, and every replica
    stands at the same position (so a checkpoint resumes at any dp)."""
    tokens = np.arange(17 * 30, dtype=np.int64) % 251
    one = ShardedBatches(tokens, 16, 4, 0, 1, seed=3)
    replicas = [ShardedBatches(tokens, 16, 4, 0, 1, seed=3, replica=r, replicas=2) for r in range(2)]
    assert replicas[0].tokens_per_batch == 2 * one.tokens_per_batch
    for _ in range(10):  # 80 sequences: over two epochs of 30
        for r in replicas:
            x, y = r.next_batch()
            want_x, want_y = one.next_batch()
            assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert replicas[0].state_dict() == replicas[1].state_dict() == one.state_dict()
    with pytest.raises(DataError, match="replica 2 must be in"):
        ShardedBatches(tokens, 16, 4, 0, 1, seed=3, replica=2, replicas=2)


def test_heldout_batches_are_deterministic_and_span_the_stream():
    tokens = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    batches = heldout_batches(tokens, 32, 4, 3)
    assert len(batches) == 3
    again = heldout_batches(tokens.copy(), 32, 4, 3)
    for (x, y), (x2, y2) in zip(batches, again):
        assert x.shape == (4, 32) and x.dtype == torch.long
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert batches[0][0][0, 0] == 0
    assert batches[-1][1][-1, -1] == tokens[-1]
    with pytest.raises(DataError, match="held-out text holds only 10 tokens"):
        heldout_batches(tokens[:10], 32, 4, 1)


def test_hf_source_parsing():
    assert HFSource.parse("hf:roneneldan/TinyStories") == HFSource("roneneldan/TinyStories")
    assert HFSource.parse("hf:wikitext:wikitext-2-raw-v1") == HFSource("wikitext", config="wikitext-2-raw-v1")
    assert HFSource.parse("hf:json:/d/*.jsonl") == HFSource("json", data_files="/d/*.jsonl")
    with pytest.raises(DataError, match="needs data files"):
        HFSource.parse("hf:json")


def test_hf_json_loading_through_datasets(tmp_path):
    rows = [{"body": f"story number {i} " * 5, "id": i} for i in range(40)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=f"hf:json:{path}", hf_text_field="body", heldout_fraction=0.2)
    corpus = load_corpus(cfg)
    assert corpus.num_documents == 40
    heldout = [r["body"].encode() for i, r in enumerate(rows) if is_heldout(str(i), 0.2)]
    train = [r["body"].encode() for i, r in enumerate(rows) if not is_heldout(str(i), 0.2)]
    assert heldout and train
    assert corpus.heldout.tobytes() == SEPARATOR.join(heldout)
    assert corpus.train.tobytes() == SEPARATOR.join(train)

    limited = load_corpus(DataConfig(path=cfg.path, hf_text_field="body", max_bytes=250))
    assert limited.num_documents == 4
    assert limited.train.size + limited.heldout.size == 250 + len(SEPARATOR) * 2

    with pytest.raises(DataError, match="has no column 'text'.*--data.hf_text_field"):
        load_corpus(DataConfig(path=cfg.path))
    with pytest.raises(DataError, match="cannot open"):
        load_corpus(DataConfig(path=f"hf:json:{tmp_path / 'missing.jsonl'}"))


def test_a_jsonl_file_is_read_as_records_not_as_json_text(tmp_path):
    rows = [{"text": f"record {i}: " + "words of the record " * 10, "id": i} for i in range(19)]
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = load_corpus(DataConfig(path=str(path), heldout_fraction=0.2))
    assert corpus.num_documents == 19, "one document per record"
    text = corpus.train.tobytes() + corpus.heldout.tobytes()
    assert b'"id"' not in text and b"{" not in text, "the JSON syntax was trained on"
    assert sum(text.count(f"record {i}:".encode()) for i in range(19)) == 19
    same_as_hf = load_corpus(DataConfig(path=f"hf:json:{path}", heldout_fraction=0.2))
    assert same_as_hf.num_documents == 19
    assert same_as_hf.train.size + same_as_hf.heldout.size == corpus.train.size + corpus.heldout.size

    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(DataError, match="line 2 is not JSON"):
        load_corpus(DataConfig(path=str(tmp_path / "bad.jsonl")))
    with pytest.raises(DataError, match="has no column 'body'"):
        load_corpus(DataConfig(path=str(path), hf_text_field="body"))


def test_max_bytes_zero_reads_a_dataset_to_its_end(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * 1000}) + "\n" for _ in range(300)))
    corpus = load_corpus(DataConfig(path=f"hf:json:{path}", max_bytes=0))
    assert corpus.num_documents == 300 and corpus.train.size + corpus.heldout.size >= 300_000


def test_hf_missing_extra_message(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(DataError, match=r"pip install 'diloco\[hf\]'"):
        load_corpus(DataConfig(path="hf:some/dataset"))

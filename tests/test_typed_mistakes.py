"""A sweep of mistakes a user can type into every command that reads or writes files: outputs that cannot be
created, read-only folders, a full disk (a small tmpfs), unreadable inputs and interrupted writes.  Each ends in
one line, ``error: ...``, and a non-zero exit, never a traceback, and leaves nothing half-written: no output,
no temporary file, no folder made for it, and an earlier output left as it was."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from diloco import cli
from tests.test_bad_input import TINY

ROOT = os.geteuid() == 0


def _mount(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Paths a mistake points at: a trained checkpoint, a plain file, a folder of someone else's files, a
    read-only folder and a full disk (tmpfs mounts as root; a folder without write bits otherwise, and no full
    disk)."""
    base = tmp_path_factory.mktemp("places")
    run = base / "run"
    assert cli.main(["train", *TINY, "--averaging.backend", "local", "--averaging.min_group_size", "1",
                     "--logging.run_dir", str(run), "--checkpoint.every", "1"]) == 0
    (base / "afile").write_text("not what the command reads\n")
    (base / "theirs").mkdir()
    (base / "theirs" / "notes.txt").write_text("mine")
    ro, full = base / "ro", base / "full"
    mounted = []
    try:
        if ROOT and _mount(ro, "ro,size=64k"):
            mounted.append(ro)
        else:
            ro.mkdir(exist_ok=True)
            ro.chmod(0o555)
        if ROOT and _mount(full, "size=64k"):
            mounted.append(full)
            _fill(full / "filler")
        yield {"ckpt": str(run), "file": str(base / "afile"), "theirs": str(base / "theirs"), "ro": str(ro),
               "full": str(full) if full in mounted else None, "tmp": str(base)}
    finally:
        for m in mounted:
            _unmount(m)
        ro.chmod(0o755)


def _fill(path: Path) -> None:
    """Take every block of the disk ``path`` is on: the next write of a page there fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError:
        pass
    finally:
        os.close(fd)


# (what the mistake is, the command line, the exit code, what the one line says, the path that must not appear)
SWEEP = [
    ("plan: the model as train takes it, a wrong preset",
     ["plan", "--model.preset", "7b"], 2, "--model.preset is '7b' but must be one of", None),
    ("plan: a config file that does not exist", ["plan", "--config", "{tmp}/nope.toml"], 2, "does not exist", None),
    ("plan: a folder as the config file", ["plan", "--config", "{tmp}"], 2, "cannot be read", None),
    ("plan: --json where no folder can be made", ["plan", "--json", "/proc/nope/plan.json"], 1,
     "cannot write /proc/nope/plan.json", "/proc/nope"),
    ("plan: --json into a read-only folder", ["plan", "--json", "{ro}/plan.json"], 1, "cannot write", "{ro}/plan.json"),
    ("plan: --json on a full disk", ["plan", "--json", "{full}/plan.json"], 1, "No space left on device",
     "{full}/plan.json"),
    ("probe: a config file that is not TOML", ["probe", "--config", "{file}", "--initial-peers", "127.0.0.1:1"], 2,
     "is not valid TOML", None),
    ("probe: a misspelt config key", ["probe", "--modl.preset", "1b", "--initial-peers", "127.0.0.1:1"], 2,
     "did you mean --model.preset?", None),
    ("probe: an option it does not have", ["probe", "--listen", "--port", "x"], 2, "invalid int value", None),
    ("data prepare: an output folder that cannot be made", ["data", "prepare", "--out", "/proc/nope/corpus"], 1,
     "cannot write /proc/nope/corpus", "/proc/nope"),
    ("data prepare: into a read-only folder",
     ["data", "prepare", "--out", "{ro}/corpus", "--data.max_bytes", "100000"], 1, "cannot write", "{ro}/corpus"),
    ("data prepare: on a full disk", ["data", "prepare", "--out", "{full}/corpus", "--data.max_bytes", "300000"], 1,
     "No space left on device", "{full}/corpus"),
    ("data prepare: --out is a file", ["data", "prepare", "--out", "{file}", "--data.max_bytes", "100000"], 1,
     "exists and is not a folder", None),
    ("data prepare: --out holds someone else's files",
     ["data", "prepare", "--out", "{theirs}", "--data.max_bytes", "100000"], 1, "holds other files", None),
    ("data prepare: a tokenizer that is not JSON",
     ["data", "prepare", "--out", "{tmp}/corpus", "--data.tokenizer", "{file}"], 1,
     "cannot be read as a tokenizer.json", "{tmp}/corpus"),
    ("tokenizer train: an output that cannot be made",
     ["tokenizer", "train", "--out", "/proc/nope/tok.json", "--data.max_bytes", "100000", "--tokenizer.vocab_size",
      "300"], 1, "cannot write /proc/nope/tok.json", "/proc/nope"),
    ("tokenizer train: into a read-only folder",
     ["tokenizer", "train", "--out", "{ro}/tok.json", "--data.max_bytes", "100000", "--tokenizer.vocab_size", "300"],
     1, "cannot write", "{ro}/tok.json"),
    ("tokenizer train: on a full disk",
     ["tokenizer", "train", "--out", "{full}/tok.json", "--data.max_bytes", "100000", "--tokenizer.vocab_size", "300"],
     1, "No space left on device", "{full}/tok.json"),
    ("tokenizer train: --out is a folder",
     ["tokenizer", "train", "--out", "{tmp}", "--data.max_bytes", "100000", "--tokenizer.vocab_size", "300"], 1,
     "it is a folder", None),
    ("export: a folder that cannot be made", ["export", "{ckpt}", "/proc/nope/hf"], 1, "cannot write /proc/nope/hf",
     "/proc/nope"),
    ("export: into a read-only folder", ["export", "{ckpt}", "{ro}/hf"], 1, "cannot write", "{ro}/hf"),
    ("export: on a full disk", ["export", "{ckpt}", "{full}/hf"], 1, "No space left on device", "{full}/hf"),
    ("export: into someone else's folder", ["export", "{ckpt}", "{theirs}"], 1, "holds other files", None),
    ("export: a model that is a text file", ["export", "{file}", "{tmp}/hf"], 1, "is not a diloco checkpoint",
     "{tmp}/hf"),
    ("generate: a model that does not exist", ["generate", "{tmp}/nope", "--prompt", "hi"], 1, "does not exist", None),
    ("generate: a prompt file that is a folder", ["generate", "{ckpt}", "--prompt-file", "{tmp}"], 2,
     "cannot read --prompt-file", None),
    ("generate: a GPU on a machine without one", ["generate", "{ckpt}", "--device", "cuda"], 2,
     "no CUDA device", None),
    ("eval: text that does not exist", ["eval", "{ckpt}", "--data.path", "{tmp}/nope.txt"], 1, "matches no file",
     None),
    ("eval: a model that is a text file", ["eval", "{file}"], 1, "is not a diloco checkpoint", None),
    ("experiment: one that does not exist", ["experiment", "nope"], 2, "unknown experiment 'nope'", None),
    ("experiment compare: an --out that cannot be made", ["experiment", "compare", "--out", "/proc/nope/c"], 1,
     "cannot write /proc/nope/c", "/proc/nope"),
    ("experiment frontier: --out in a read-only folder",
     ["experiment", "frontier", "--out", "{ro}/f", "--codecs", ""], 1, "cannot write", "{ro}/f"),
    ("experiment frontier: --out on a full disk",
     ["experiment", "frontier", "--out", "{full}/f", "--codecs", ""], 1, "No space left on device", "{full}/f"),
    ("experiment horizon: --out is a file", ["experiment", "horizon", "--out", "{file}"], 1,
     "exists and is not a folder", None),
    ("experiment auto-codec: an option it does not have", ["experiment", "auto-codec", "--fast"], 2,
     "expected one argument", None),
    ("experiment sweeps: a sweep that does not exist", ["experiment", "sweeps", "--sweep", "nope"], 2,
     "--sweep must be one of", None),
    ("experiment overlap: a rate that is not one", ["experiment", "overlap", "--rates", "fast"], 2,
     "invalid rate 'fast'", None),
    ("train: the outer state on a GPU this machine lacks", ["train", *TINY, "--diloco.master_device", "cuda"], 2,
     "--diloco.master_device cuda: this machine has no CUDA device", None),
    ("train: a device this machine lacks", ["train", *TINY, "--device", "cuda"], 2,
     "--device cuda: this machine has no CUDA device", None),
    ("train: more GPUs than the island has ranks", ["train", *TINY, "--parallel.gpus", "2"], 2,
     "--parallel.gpus must be between 0 (one GPU per rank) and the island's 1 rank(s), got 2", None),
    ("train: ranks placed on GPUs of a CPU island", ["train", *TINY, "--parallel.tp", "2", "--parallel.gpus", "1",
                                                     "--device", "cpu"], 2,
     "--parallel.gpus 1 places the island's ranks on GPUs, but --device is cpu", None),
    ("train: SparseLoCo's two flags without its codec", ["train", *TINY, "--diloco.outer_optimizer", "sparseloco",
                                                         "--diloco.outer_lr", "4"], 2,
     "add --averaging.compression topk (SparseLoCo's whole recipe", None),
]


@pytest.mark.parametrize("mistake, argv, code, says, absent", SWEEP, ids=[s[0] for s in SWEEP])
def test_a_typed_mistake_ends_in_one_line_and_leaves_nothing(places, capsys, mistake, argv, code, says, absent):
    import torch

    if any("{full}" in a for a in argv) and places["full"] is None:
        pytest.skip("a full disk needs a tmpfs mount (root)")
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    argv = [a.format(**places) for a in argv]
    parents = {Path(a).parent for a in argv if a.startswith(places["tmp"])}
    before = {p: sorted(os.listdir(p)) for p in parents if p.is_dir()}
    assert _exit_code(argv) == code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert ".tmp-" not in lines[0], "the line names the output the user gave, not its temporary name"
    if absent is not None:
        assert not Path(absent.format(**places)).exists()
    for p, names in before.items():  # no temporary file or folder left beside an output
        assert sorted(os.listdir(p)) == names, f"{p} changed"


def _exit_code(argv: list[str]) -> int:
    """What ``diloco ARGV`` exits with, run in this process (argparse's refusals exit through SystemExit)."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return int(e.code)


def _interrupt_after(monkeypatch, owner, name: str, calls: int = 1) -> None:
    """Make ``owner.name`` raise KeyboardInterrupt (Ctrl-C) at its ``calls``-th call, after doing its work."""
    real, count = getattr(owner, name), [0]

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        count[0] += 1
        if count[0] >= calls:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(owner, name, wrapped)


def test_an_interrupted_prepare_keeps_the_earlier_corpus_and_leaves_no_part_of_the_new(tmp_path, capsys,
                                                                                     monkeypatch):
    from diloco.data import prepared

    out = tmp_path / "corpus"
    args = ["data", "prepare", "--out", str(out), "--data.max_bytes", "100000"]
    assert cli.main(args) == 0
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    _interrupt_after(monkeypatch, prepared._Split, "add")  # Ctrl-C once the first ids are on disk
    assert cli.main(args[:-1] + ["200000"]) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]
    monkeypatch.undo()
    _interrupt_after(monkeypatch, prepared._Split, "add")
    assert cli.main(["data", "prepare", "--out", str(tmp_path / "new" / "corpus"), "--data.max_bytes", "100000"]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"], "the folders made for it were left behind"


def test_an_interrupted_tokenizer_and_export_leave_nothing(places, tmp_path, capsys, monkeypatch):
    from diloco.data.tokenizer import Tokenizer
    from diloco.model import hf

    _interrupt_after(monkeypatch, Tokenizer, "save")  # the file is written whole, then Ctrl-C before the rename
    assert cli.main(["tokenizer", "train", "--out", str(tmp_path / "tok.json"), "--data.max_bytes", "100000",
                     "--tokenizer.vocab_size", "300"]) == 130
    _interrupt_after(monkeypatch, hf, "export_hf")
    assert cli.main(["export", places["ckpt"], str(tmp_path / "hf")]) == 130
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err.count("interrupted") == 2

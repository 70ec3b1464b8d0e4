"""What a new user may type wrong gets one line and a non-zero exit, or the documented behaviour; never
silence, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from diloco import cli
from tests.conftest import tiny_config

TINY = ["--model.preset", "tiny", "--diloco.inner_steps", "2", "--diloco.outer_steps", "1", "--inner.batch_size", "4",
        "--data.max_bytes", "300000", "--wandb.mode", "disabled", "--threads", "1", "--logging.eval_batches", "1"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_non_finite_settings_are_refused_up_front(capsys):
    for key, value in (("--diloco.outer_lr", "nan"), ("--inner.lr", "inf")):
        assert cli.main(["train", *TINY, key, value]) == 2
        assert f"{key} must be a finite number" in _one_error_line(capsys)


def test_a_run_dir_that_cannot_be_created_is_one_line_before_any_peer_starts(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = cli.main(["train", *TINY, "--averaging.backend", "hivemind", "--logging.run_dir", str(blocker / "run")])
    assert code == 1
    assert "cannot create --logging.run_dir" in _one_error_line(capsys)


def test_bad_data_leaves_no_run_dir_behind(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path in (tmp_path / "missing.txt", empty):
        run_dir = tmp_path / f"run-{path.name}"
        assert cli.main(["train", *TINY, "--data.path", str(path), "--averaging.backend", "hivemind",
                         "--logging.run_dir", str(run_dir)]) == 1
        assert str(path) in _one_error_line(capsys)
        assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


def test_a_taken_port_leaves_no_keys_behind_and_keeps_what_was_there(tmp_path, capsys, no_leaked_daemons):
    import socket

    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["train", *TINY, "--averaging.backend", "hivemind", "--averaging.min_group_size", "2",
                         "--averaging.transport_port", str(port), "--logging.run_dir", str(tmp_path)])
    assert code == 1
    assert f"127.0.0.1:{port}" in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], "identity, port and run key left behind"


def test_resume_with_nothing_to_resume_says_so(tmp_path, caplog):
    code = cli.main(["train", *TINY, "--averaging.backend", "local", "--averaging.min_group_size", "1",
                     "--logging.run_dir", str(tmp_path), "--resume"])
    assert code == 0
    assert f"--resume: no checkpoint in {tmp_path / 'checkpoints'}; starting fresh" in caplog.text


def test_a_fresh_run_sets_an_earlier_runs_checkpoints_aside(tmp_path, caplog):
    """A new run in a run dir that holds another run's checkpoints must never resume from them later."""
    args = ["train", *TINY, "--averaging.backend", "local", "--averaging.min_group_size", "1",
            "--logging.run_dir", str(tmp_path), "--checkpoint.every", "1"]
    assert cli.main(args + ["--diloco.outer_steps", "3"]) == 0
    assert cli.main(args + ["--diloco.outer_steps", "2"]) == 0
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("ckpt-*.pt")) == ["ckpt-000001.pt", "ckpt-000002.pt"]
    assert [sorted(p.name for p in d.glob("ckpt-*.pt")) for d in ckpts.glob("earlier-*")] == \
        [["ckpt-000001.pt", "ckpt-000002.pt", "ckpt-000003.pt"]]
    assert "held an earlier run's checkpoints: moved them to" in caplog.text
    caplog.clear()
    caplog.set_level("INFO", logger="diloco")
    assert cli.main(args + ["--diloco.outer_steps", "3", "--resume"]) == 0
    assert "ckpt-000002.pt at outer step 2" in caplog.text  # the new run's own newest, not the earlier run's round 3


def test_a_wrong_run_key_is_one_line_within_the_startup_timeout(tmp_path, capsys, no_leaked_daemons):
    first_cfg = tiny_config(tmp_path / "first")
    maddrs = tmp_path / "maddrs.txt"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = subprocess.Popen(
        [sys.executable, "-m", "diloco.cli", "train", *TINY, "--averaging.backend", "hivemind",
         "--averaging.run_key", "the-right-key", "--averaging.maddr_file", str(maddrs), "--diloco.outer_steps", "50",
         "--diloco.inner_steps", "50", "--logging.run_dir", first_cfg.logging.run_dir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not maddrs.exists():
            assert first.poll() is None and time.time() < deadline, "the first island did not start"
            time.sleep(0.2)
        t0 = time.monotonic()
        code = cli.main(["train", *TINY, "--averaging.backend", "hivemind", "--averaging.startup_timeout", "10",
                         "--initial-peers", maddrs.read_text().split()[0], "--averaging.run_key", "a-wrong-key",
                         "--logging.run_dir", str(tmp_path / "second")])
        took = time.monotonic() - t0
    finally:
        first.terminate()
        first.wait(60)
    assert code == 1
    assert "hold another run key" in _one_error_line(capsys)
    print(f"wrong run key refused after {took:.1f} s (startup timeout 10 s)")

"""Shared test helpers: tiny configs, one thread per process, and a check that no daemon leaks."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

# marks every process this test session starts (p2pd daemons inherit it), so leak checks ignore
# daemons of other sessions running on the same machine
SESSION_MARK = f"DILOCO_TEST_SESSION={uuid.uuid4().hex}"
os.environ["DILOCO_TEST_SESSION"] = SESSION_MARK.split("=", 1)[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
# islands of one process fork from a warm interpreter (diloco/launch/warm.py): 5 s less CPU each; the tests
# that launch as users do set it to 0
os.environ.setdefault("DILOCO_WARM_ISLANDS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from diloco.config import Config  # noqa: E402
from diloco.config.loader import load  # noqa: E402


def tiny_config(run_dir, **overrides) -> Config:
    """A `tiny` model config that trains in seconds, with W&B off and no peers."""
    items = {
        "model.preset": "tiny", "diloco.inner_steps": 5, "diloco.outer_steps": 3, "inner.batch_size": 4,
        "inner.warmup_steps": 2, "logging.run_dir": str(run_dir), "logging.eval_batches": 2,
        "wandb.mode": "disabled", "averaging.backend": "local", "averaging.min_group_size": 1,
        "checkpoint.every": 0, "threads": 1, "data.max_bytes": 2_000_000,
    }
    items.update(overrides)
    return load(None, {k: v for k, v in items.items()})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked ``alone`` runs while the other workers wait between their tests: an
    exclusive lock on a file of this test run, which every other test holds shared (setup, call, teardown)."""
    worker = getattr(item.config, "workerinput", None)
    if worker is None:
        yield
        return
    import fcntl

    with open(f"/tmp/diloco-tests-{worker['testrunuid']}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        yield


def p2pd_pids() -> set[int]:
    """Process ids of running p2pd daemons started by this test session."""
    out = subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True, text=True).stdout
    mine = set()
    for pid in map(int, out.split()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if SESSION_MARK.encode() in f.read().split(b"\0"):
                    mine.add(pid)
        except OSError:
            continue
    return mine


@pytest.fixture
def no_leaked_daemons():
    """Fail the test if it leaves p2pd daemons behind."""
    before = p2pd_pids()
    yield
    deadline = time.time() + 10
    while time.time() < deadline and (p2pd_pids() - before):
        time.sleep(0.2)
    leaked = p2pd_pids() - before
    assert not leaked, f"test left p2pd daemons running: {sorted(leaked)}"


def wait_until(predicate, timeout: float, every: float = 0.01) -> bool:
    """Poll ``predicate()`` every ``every`` seconds until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def assert_joined(joiner, first, outer_step: int) -> None:
    """``joiner`` joins the run and ends up with ``first``'s outer step, θ_global (in its master copy and
    its parameters) and non-zero outer momentum, bit for bit."""
    assert joiner.transfer.join_from_peers()
    assert joiner.stats.outer_step == outer_step
    for name, t in first.outer.theta_global.items():
        assert torch.equal(joiner.outer.theta_global[name], t)
        assert torch.equal(joiner.params[name].detach(), t.detach())
    for a, b in zip(first.outer.momentum_buffers(), joiner.outer.momentum_buffers()):
        assert torch.equal(a, b) and a.abs().sum() > 0


# On loopback with several islands on 2 shared cores, hivemind now and then loses one all-reduce part (about
# 1 round in 40 here); the vote detects it and every island rolls that round back together.  Such a round is
# no outcome of what a test checks, so tests set it aside and assert on every other round.
PART_LOST = "islands received different averages (an all-reduce part failed)"


def real_failures(summary: dict) -> list[str]:
    """An island's failed rounds other than hivemind's lost all-reduce parts."""
    return [f for f in summary["failures"] if PART_LOST not in f]


# ------------------------------------------------------------------------------------- the collective audit
AUDITED = str(Path(__file__).with_name("audited_rank.py"))
"""The program every audited rank runs first (it installs :mod:`tests.collective_audit`, then runs the rank's own)."""
AUDIT_OFF = "DILOCO_COLLECTIVE_AUDIT_OFF"
"""``1``: run the multi-rank tests without the collective audit."""
_audit_dirs: list[Path] = []
_audit_checked: set[Path] = set()
_start_group = None


def audit_env(where: Path, stand_in: str = "") -> dict[str, str]:
    """The environment that makes the ranks of one launch record into a fresh folder under ``where`` (empty with the
    audit off); ``stand_in``: see :data:`tests.collective_audit.STAND_IN_ENV`."""
    from tests import collective_audit as audit

    if os.environ.get(AUDIT_OFF) == "1":
        return {}
    folder = Path(where) / f"audit-{uuid.uuid4().hex[:8]}"
    _audit_dirs.append(folder)
    env = {audit.ENV: str(folder)}
    if stand_in:
        env[audit.STAND_IN_ENV] = stand_in
    if os.environ.get(audit.DETAIL_ENV) == "1":
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    return env


def audit_problems() -> list[str]:
    """The rules the launches since the last call broke (each launch's folder is read once its ranks ended)."""
    from tests import collective_audit as audit

    problems = []
    for folder in _audit_dirs:
        if folder not in _audit_checked:
            _audit_checked.add(folder)
            problems += audit.check(folder)
    return problems


def _audited_start_group(argv: list[str], nproc: int, env: dict[str, str], log: Path, append_log: bool = False, *,
                         program: str = "diloco.cli", **kw):
    """``warm.start_group`` with the audit in front of each rank's program (whoever starts the group: the launchers
    below, ``simulate``'s clusters, a test)."""
    extra = {} if env.get("DILOCO_COLLECTIVE_AUDIT") else audit_env(Path(log).parent)
    if not extra and not env.get("DILOCO_COLLECTIVE_AUDIT"):
        return _start_group(argv, nproc, env, log, append_log, program=program, **kw)
    return _start_group([program, *argv], nproc, {**env, **extra}, log, append_log, program=AUDITED, **kw)


@pytest.fixture(scope="session", autouse=True)
def collective_audit_on():
    """Every torchrun group the session starts warm runs under the collective audit (:mod:`tests.collective_audit`),
    module-scoped fixtures' groups included; :func:`collective_audit` reads what they recorded."""
    global _start_group
    from diloco.launch import warm

    _start_group = warm.start_group
    warm.start_group = _audited_start_group
    yield
    warm.start_group = _start_group


@pytest.fixture(autouse=True)
def collective_audit(collective_audit_on):
    """Fail the test when a multi-rank launch of it (or of a fixture it uses) broke one of NCCL's rules."""
    audit_problems()  # launches of earlier tests were read by them
    yield
    problems = audit_problems()
    assert not problems, "the collective audit found:\n" + "\n".join(problems[:20])


def torchrun_train(cfg: Config, nproc: int, where: Path, timeout: float = 240.0) -> Path:
    """Run ``diloco train`` with ``cfg`` under torchrun, or its warm stand-in (``nproc`` gloo processes, one thread
    each), and return its log; the whole process tree is killed if it outlives ``timeout``.  Fails with the log's
    tail unless it exits 0."""
    import signal
    import sys

    import tomli_w

    from diloco.config import to_dict
    from diloco.launch import warm
    from peers.proctable import descendants

    path = where / f"config-{nproc}-{len(list(where.glob('config-*.toml')))}.toml"
    path.write_text(tomli_w.dumps(to_dict(cfg)))
    log = path.with_suffix(".log")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    if warm.enabled():
        proc = warm.start_group(["train", "--config", str(path)], nproc, env, log)
    else:
        audit = audit_env(where)
        program = [AUDITED, "diloco.cli"] if audit else ["-m", "diloco.cli"]
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                                     "--nproc-per-node", str(nproc), *program, "train", "--config", str(path)],
                                    stdout=out, stderr=subprocess.STDOUT, env=dict(env, **audit),
                                    start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            for pgid in {stat.pgid for stat in descendants(proc.pid).values()} | {proc.pid}:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]
    return log


REPO = str(Path(__file__).resolve().parents[1])


def kill_seen(processes: dict[int, str]) -> None:
    """SIGKILL each process ``pid`` of ``{pid: name}`` that still runs under the name it was seen with (not a
    new process under a reused pid)."""
    for pid, name in processes.items():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    os.kill(pid, 9)
        except OSError:
            pass


def launch_ranks(script: str, args: list[str], world: int, out_dir: Path, timeout_s: float,
                 stand_in: str = "") -> None:
    """Run ``script args`` as ``world`` gloo ranks (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` set, one
    thread each, the repository on the path) under the collective audit: forked warm as one group, or started
    cold, one process a rank.  If one rank fails or time runs out, end them all with whatever they started (DHTs,
    p2pd daemons) and fail with their logs; fail too when the audit found a rule broken.  ``stand_in``: see
    :data:`tests.collective_audit.STAND_IN_ENV`."""
    import signal
    import sys

    from diloco.launch import warm
    from peers.proctable import descendants
    from pipeline.mesh import free_port

    audit = audit_env(out_dir, stand_in)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **audit)
    if warm.enabled():
        logs = [out_dir / "ranks.log"]
        procs = [warm.start_group(args, world, env, logs[0], program=script)]
    else:
        if audit:
            script, args = AUDITED, [script, *args]
        port = free_port()
        procs, logs = [], []
        for rank in range(world):
            logs.append(out_dir / f"rank{rank}.log")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, script, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))))
    deadline = time.monotonic() + timeout_s
    children: dict[int, str] = {}  # what the ranks started, to end it after a crash
    tick = 0
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            if tick % 10 == 0:
                for p in procs:
                    children.update({pid: stat.name for pid, stat in descendants(p.pid).items()})
            tick += 1
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                children.update({pid: stat.name for pid, stat in descendants(p.pid).items()})
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            p.wait()
        if any(p.returncode != 0 for p in procs):
            kill_seen(children)
    if any(p.returncode != 0 for p in procs):
        raise AssertionError(f"ranks failed (exit codes {[p.returncode for p in procs]}):\n"
                             + "\n----\n".join(log.read_text()[-4000:] for log in logs))
    problems = audit_problems()
    assert not problems, "the collective audit found:\n" + "\n".join(problems[:20])


@pytest.fixture
def arrives_on_time(monkeypatch):
    """A round in flight is applied at the first step it may be, as a round on the training thread is with
    nobody to wait for: the round thread is waited for there (when it is applied is otherwise a race, and so
    is the trajectory of delayed and eager)."""
    from diloco.engine.round import OuterRounds

    due = OuterRounds.apply_due

    def deterministic(self) -> bool:
        f = self.flight
        if f is not None and f.job is not None and f.ripe(self.stats.inner_step):
            f.job.thread.join()
        return due(self)

    monkeypatch.setattr(OuterRounds, "apply_due", deterministic)


@pytest.fixture
def delay_line_ok():
    """Skip a test that needs emulated hosts with a delay line where this machine cannot give them (not root)."""
    from experiments.netns import available

    ok, reason = available(delay=True)
    if not ok:
        pytest.skip(reason)


def delay_line_network(prefix: str, n_hosts: int = 2, **kwargs):
    """Emulated hosts behind a delay line, named apart from any other test's (``prefix``, the pid, a random tag)."""
    import secrets

    from experiments.netns import EmulatedNetwork

    return EmulatedNetwork(n_hosts, run_id=f"{prefix}{os.getpid()}{secrets.token_hex(2)}", delay_line=True, **kwargs)


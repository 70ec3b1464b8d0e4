"""Emulated slow links (experiments/netns.py) on real namespaces, veths and tbf qdiscs."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from experiments.netns import (
    EmulatedNetwork,
    available,
    cleanup_stale,
    list_namespaces,
    parse_rate,
)
from peers.proctable import is_running

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ parse_rate (no root needed)


@pytest.mark.parametrize(
    "text, bits",
    [
        ("20mbit", 20e6),
        ("1gbit", 1e9),
        ("500kbit", 500e3),
        ("20Mbit", 20e6),
        ("1.5mbit/s", 1.5e6),
        ("64kibit", 65536),
        ("2e7", 2e7),
        ("100000bit", 1e5),
        (20_000_000, 2e7),
    ],
)
def test_parse_rate(text, bits):
    assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("bad", ["", "fast", "20", "-5mbit", "0mbit", "20mbps", "20MB", "20 zbit", "nanmbit", None, True])
def test_parse_rate_rejects(bad):
    with pytest.raises(ValueError):
        parse_rate(bad)


# ------------------------------------------------------------------ real namespaces


@pytest.fixture
def netns_ok():
    ok, reason = available()
    if not ok:
        pytest.skip(reason)


def _run_id() -> str:
    return f"t{os.getpid()}{secrets.token_hex(2)}"


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.strip()}


def _ns_of(base: str) -> list[str]:
    return sorted(n for n in list_namespaces(base) if re.fullmatch(re.escape(base) + r"-(hub|h\d+)", n))


def _gone(base: str) -> None:
    assert _ns_of(base) == [], f"namespaces left: {_ns_of(base)}"


def test_two_hosts_rate_reach_and_cleanup(netns_ok):
    links_before = _root_links()
    rid = _run_id()
    with EmulatedNetwork(2, rate="20mbit", run_id=rid) as net:
        base = net.base
        assert _ns_of(base) == sorted(net.namespaces)
        assert [h.address for h in net.hosts] == ["10.77.0.1", "10.77.0.2"]
        assert net.wrap(["true"], 1) == ["ip", "netns", "exec", net.hosts[1].namespace, "true"]
        assert _root_links() == links_before, "the root namespace's links must not change"
        assert net.can_reach(0, 1) and net.can_reach(1, 0)
        bps = net.measure_rate(0, 1, seconds=2)
        print(f"measured {bps / 1e6:.2f} Mbit/s at a 20mbit cap")
        assert 0.5 * 20e6 <= bps <= 1.1 * 20e6
        net.set_rate("4mbit")  # a link that slows down in the middle of a run, both ways
        assert net.rate_bits == 4e6
        for src, dst in ((0, 1), (1, 0)):
            assert 0.5 * 4e6 <= net.measure_rate(src, dst, seconds=1) <= 1.1 * 4e6
        # a process left running in a namespace is ended by close()
        sleeper = net.popen(["sleep", "60"], 1)
    assert net.closed
    _gone(base)
    assert sleeper.poll() is not None
    assert not (_root_links() - links_before)
    net.close()  # idempotent


_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=float(sys.argv[2]))
    print("connected")
except ConnectionRefusedError:
    print("refused")
except TimeoutError:
    print("timed out")
"""


def _connect_to_closed_port(net: EmulatedNetwork, src: int, dst: int, timeout: float = 2.0) -> str:
    """What a TCP connection from ``src`` to a port nobody listens on at ``dst`` meets."""
    return subprocess.run(net.wrap([sys.executable, "-c", _CONNECT, net.hosts[dst].address, str(timeout)], src),
                          capture_output=True, text=True, timeout=timeout + 20).stdout.strip()


def test_partition_cuts_the_sides_apart_silently_and_heal_joins_them(netns_ok):
    with EmulatedNetwork(3, rate="20mbit", run_id=_run_id()) as net:
        with pytest.raises(ValueError):
            net.partition([[0, 1], [1, 2]])  # a host on both sides
        with pytest.raises(ValueError):
            net.partition([[0, 1, 2]])  # one side is no partition
        net.partition([[0], [1, 2]])
        assert net.sides == [[0], [1, 2]]
        assert not net.can_reach(0, 1) and not net.can_reach(2, 0)
        assert net.can_reach(1, 2) and net.can_reach(2, 1)
        # packets vanish: a closed port beyond the cut does not refuse, the connection times out
        assert _connect_to_closed_port(net, 0, 1) == "timed out"
        assert _connect_to_closed_port(net, 1, 2) == "refused"
        net.partition([[0, 1], [2]])  # a new cut replaces the old one
        assert net.can_reach(0, 1) and not net.can_reach(1, 2)
        net.heal()
        assert net.sides == []
        assert net.can_reach(0, 1) and net.can_reach(1, 0) and net.can_reach(2, 0) and net.can_reach(1, 2)
        assert _connect_to_closed_port(net, 0, 2) == "refused"
        net.heal()  # healing a whole network does nothing


def test_close_on_exception(netns_ok):
    rid = _run_id()
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedNetwork(2, rate="20mbit", run_id=rid) as net:
            assert list_namespaces(net.base)
            raise RuntimeError("boom")
    assert net.closed
    _gone(net.base)


def test_handlers_restored(netns_ok):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with EmulatedNetwork(1, run_id=_run_id()):
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in before} == before


def _suicide():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)


def test_forked_child_signal_leaves_network_alone(netns_ok):
    import multiprocessing

    with EmulatedNetwork(1, run_id=_run_id()) as net:
        p = multiprocessing.get_context("fork").Process(target=_suicide)
        p.start()
        p.join(10)
        assert p.exitcode == -signal.SIGTERM
        assert _ns_of(net.base) == sorted(net.namespaces), "a forked child's SIGTERM must not tear down"
    _gone(net.base)


CHILD = textwrap.dedent(
    """
    import faulthandler, json, signal, subprocess, sys, time
    from experiments.netns import EmulatedNetwork
    faulthandler.register(signal.SIGUSR1)  # the test asks for our stack if we hang
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a shell, whatever pytest's process inherited
    net = EmulatedNetwork(2, rate="20mbit", run_id=sys.argv[1])
    sleeper = net.popen(["sleep", "60"], 0)
    print(json.dumps({"base": net.base, "sleeper": sleeper.pid}), flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(3)
    """
)


def _start_child(rid: str) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", CHILD, rid], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=REPO)
    line = p.stdout.readline()
    assert line, "child failed to build its network"
    info = json.loads(line)
    assert _ns_of(info["base"]) == sorted([f"{info['base']}-hub", f"{info['base']}-h0", f"{info['base']}-h1"])
    return p, info


def _wait_dead(pid: int, timeout: float = 5) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not is_running(pid):  # our grandchild may linger as a zombie if nobody reaps it
            return True
        time.sleep(0.05)
    return False


def test_sigterm_cleans_up(netns_ok):
    p, info = _start_child(_run_id())
    p.send_signal(signal.SIGTERM)
    assert _exit_code(p) == -signal.SIGTERM  # cleaned up, then died of SIGTERM
    _gone(info["base"])
    assert _wait_dead(info["sleeper"])


def _exit_code(p: subprocess.Popen, timeout: float = 30) -> int:
    """The child's exit code; if it hangs, fail with its stack (it dumps it on SIGUSR1)."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)
        time.sleep(1)
        p.kill()
        pytest.fail(f"the child did not exit within {timeout} s; its stack:\n{p.stderr.read()}")


def test_sigint_cleans_up_and_raises_keyboardinterrupt(netns_ok):
    p, info = _start_child(_run_id())
    p.send_signal(signal.SIGINT)
    assert _exit_code(p) == 3
    assert "KeyboardInterrupt" in p.stdout.read()
    _gone(info["base"])
    assert _wait_dead(info["sleeper"])


def test_cleanup_stale_after_sigkill(netns_ok):
    rid = _run_id()
    with EmulatedNetwork(1, run_id=f"{rid}live") as live:
        p, info = _start_child(rid)
        p.kill()
        p.wait(timeout=10)
        assert _ns_of(info["base"]), "SIGKILL cannot clean up; namespaces should remain"
        removed = cleanup_stale(f"dlc-t{os.getpid()}")
        assert sorted(removed) == sorted([f"{info['base']}-hub", f"{info['base']}-h0", f"{info['base']}-h1"])
        _gone(info["base"])
        assert _wait_dead(info["sleeper"])
        assert _ns_of(live.base) == sorted(live.namespaces), "a live run must be spared"
    _gone(live.base)

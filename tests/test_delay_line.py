"""The userspace delay line (experiments/delay_line.py) behind EmulatedNetwork, on real namespaces and TUN devices.

Bounds are wide on purpose: the machine is shared and small, and the delay line only ever adds delay.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from experiments.netns import (
    EmulatedNetwork,
    add_link_arguments,
    cleanup_stale,
    link_arguments,
    list_namespaces,
)
from peers.proctable import is_running
from tests.conftest import delay_line_network, wait_until

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ bad settings (no root needed)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rtt_ms": -1}, "rtt_ms must be a number of milliseconds"),
        ({"rtt_ms": float("nan")}, "rtt_ms must be"),
        ({"rtt_ms": 10, "jitter_ms": 6}, "jitter_ms must not exceed half of rtt_ms"),
        ({"loss": 1.0}, r"loss must be a fraction of packets in \[0, 1\)"),
        ({"loss": -0.1}, "loss must be a fraction"),
        ({"nat": [2]}, r"nat must list host indices in 0..1"),
        ({"latency_ms": 5, "rtt_ms": 10}, "not both"),
        ({"loss": 0.1, "delay_line": False}, "need the delay line"),
        ({"tun_mtu": 100}, "tun_mtu must be"),
    ],
)
def test_bad_settings_are_one_sentence(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EmulatedNetwork(2, rate="20mbit", **kwargs)


def _flags(*argv: str, rate: str | None = "20mbit") -> dict[str, float]:
    parser = argparse.ArgumentParser()
    add_link_arguments(parser)
    return link_arguments(parser.parse_args(list(argv)), rate)


def test_link_flags():
    assert _flags(rate=None) == {"rtt_ms": 0.0, "jitter_ms": 0.0, "loss": 0.0}
    assert _flags("--rtt", "100", "--jitter", "5", "--loss", "0.01") == {"rtt_ms": 100.0, "jitter_ms": 5.0,
                                                                         "loss": 0.01}
    for argv, match in ((("--rtt", "fast"), "--rtt must be a number, got 'fast'"),
                        (("--loss", "2"), "--loss must be a fraction"),
                        (("--rtt", "10", "--jitter", "20"), "--jitter must not exceed half of --rtt")):
        with pytest.raises(ValueError, match=match):
            _flags(*argv)
    with pytest.raises(ValueError, match="give --rate too"):
        _flags("--loss", "0.01", rate=None)


# ------------------------------------------------------------------ real namespaces


def _net(n_hosts: int = 2, **kwargs) -> EmulatedNetwork:
    return delay_line_network("d", n_hosts, **kwargs)


def _port(p: subprocess.Popen, timeout: float = 10) -> int:
    ready = select.select([p.stdout], [], [], timeout)[0]
    line = p.stdout.readline() if ready else ""
    assert line.strip().isdigit(), f"the server did not start: {line!r}"
    return int(line)


ECHO_SERVER = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); s.settimeout(20)
print(s.getsockname()[1], flush=True)
c, peer = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
print(peer[0], flush=True)
while (b := c.recv(1 << 16)):
    c.sendall(b)
"""

ECHO_CLIENT = r"""
import json, socket, sys, time
addr, port, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = time.monotonic(); c = socket.create_connection((addr, port), timeout=5); connect = time.monotonic() - t
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
echo = []
for i in range(n):
    msg = bytes([i % 256]) * size; got = b""
    t = time.monotonic(); c.sendall(msg)
    while len(got) < size:
        got += c.recv(size - len(got))
    echo.append(time.monotonic() - t)
    assert got == msg
print(json.dumps({"connect": connect, "echo": sorted(echo)}))
"""


def _echo(net: EmulatedNetwork, client: int, server: int, n: int = 10, size: int = 1) -> dict:
    """Connect from host ``client`` to an echo server on host ``server`` and time ``n`` echoes of ``size`` bytes."""
    srv = net.popen([sys.executable, "-c", ECHO_SERVER, net.hosts[server].local_address], server,
                    stdout=subprocess.PIPE, text=True)
    try:
        out = subprocess.run(net.wrap([sys.executable, "-c", ECHO_CLIENT, net.hosts[server].address,
                                       str(_port(srv)), str(n), str(size)], client),
                             check=False, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr[-2000:]
        return dict(json.loads(out.stdout), peer=srv.stdout.readline().strip())
    finally:
        net.reap(srv)


def test_rtt(delay_line_ok):
    with _net(2, rate="50mbit", rtt_ms=40) as net:
        res = _echo(net, 0, 1)
        print(f"connect {res['connect'] * 1e3:.1f} ms, echo {[round(e * 1e3, 1) for e in res['echo']]} ms at 40 ms RTT")
        # a SYN and its SYN-ACK each wait 20 ms; nothing can come back sooner, the machine may add a lot later
        assert 0.039 <= res["connect"] <= 0.5
        assert res["echo"][0] >= 0.039
        assert res["echo"][len(res["echo"]) // 2] <= 0.1


def test_rate_caps_uplink_and_downlink(delay_line_ok):
    cap = 30e6
    with _net(3, rate="30mbit", rtt_ms=10) as net:
        alone = net.measure_rate(0, 1, seconds=2)
        print(f"one sender: {alone / 1e6:.2f} Mbit/s at a 30 Mbit/s cap")
        assert 0.5 * cap < alone <= 1.1 * cap
        # two senders into one receiver share its downlink
        rates: dict[int, float] = {}
        senders = [threading.Thread(target=lambda s=s: rates.__setitem__(s, net.measure_rate(s, 1, seconds=3)))
                   for s in (0, 2)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(60)
        print(f"two senders into one host: {rates[0] / 1e6:.2f} + {rates[2] / 1e6:.2f} Mbit/s")
        assert rates[0] + rates[2] <= 1.25 * cap  # their windows overlap all but the start-up of one
        assert min(rates.values()) > 0.15 * cap


UDP_RECEIVER = r"""
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 0))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
print(s.getsockname()[1], flush=True)
s.settimeout(10); seqs = []
while True:
    try:
        seqs.append(int(s.recv(64)))
    except socket.timeout:
        break
    s.settimeout(1.0)  # the sender is done once nothing came for a second
print(json.dumps(seqs), flush=True)
"""

UDP_SENDER = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    s.sendto(str(i).encode(), (sys.argv[1], int(sys.argv[2])))
    time.sleep(0.001)  # gently: the host's own queues must not drop anything
"""


def test_loss_and_jitter_keep_order(delay_line_ok):
    sent = 1000
    with _net(2, rate="50mbit", rtt_ms=20, jitter_ms=10, loss=0.2) as net:
        rx = net.popen([sys.executable, "-c", UDP_RECEIVER, net.hosts[1].local_address], 1, stdout=subprocess.PIPE,
                       text=True)
        try:
            port = _port(rx)
            tx = subprocess.run(net.wrap([sys.executable, "-c", UDP_SENDER, net.hosts[1].address, str(port),
                                          str(sent)], 0), check=False, capture_output=True, text=True,
                                timeout=30)
            assert tx.returncode == 0, tx.stderr
            out, _ = rx.communicate(timeout=30)
        finally:
            net.reap(rx)
    seqs = json.loads(out.strip().splitlines()[-1])
    lost = 1 - len(seqs) / sent
    print(f"lost {lost:.1%} of {sent} datagrams at loss=0.2")
    assert 0.12 <= lost <= 0.28  # binomial sd is 1.3%: 6 sd either way
    assert seqs == sorted(seqs), "jitter must not reorder the packets of one direction of a host pair"


def test_nat_host_accepts_nothing_but_connects_out(delay_line_ok):
    with _net(2, rate="50mbit", rtt_ms=10, nat=(1,)) as net:
        assert not net.can_reach(0, 1, timeout=1.5), "a host behind NAT must not accept inbound connections"
        assert net.can_reach(1, 0)
        res = _echo(net, 1, 0, n=5, size=100_000)  # replies, and bulk data both ways, on its own connection
        assert len(res["echo"]) == 5
        # its NAT rewrote its private address to its public one, as a real NAT does
        hidden = net.hosts[1]
        assert hidden.local_address != hidden.address and res["peer"] == hidden.address, res["peer"]


TRANSPORT_HOST = r"""
import json, sys, time
from peers.identity import Identity
from peers.wire.transport import Transport, TransportError
t = Transport(Identity.generate(), "key", host=sys.argv[1], advertise=sys.argv[2], reachable=sys.argv[3] == "1",
              punch=sys.argv[4] == "1")
print(t.endpoint, t.peer_id, flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if "reach" in cmd:
        t.reach(cmd["reach"]); out = {}
    elif "send" in cmd:
        try:
            t.send(cmd["send"], cmd["key"], bytes(range(256)) * (cmd["size"] // 256), time.monotonic() + 20)
            out = {"ok": True}
        except TransportError as e:
            out = {"ok": False, "error": str(e)}
    elif "recv" in cmd:
        got = t.box.wait_for(cmd["recv"], lambda d: cmd["sender"] in d, time.monotonic() + 20)
        value = got.get(cmd["sender"])
        out = {"size": len(value) if value is not None else -1,
               "intact": value is not None and bytes(value) == bytes(range(256)) * (len(value) // 256)}
    else:
        out = dict(vars(t.stats), punch_failed=t.punch_failed())
    print(json.dumps(out), flush=True)
"""


class _TransportHost:
    """A real transport in host ``index`` of ``net``, driven over its stdin."""

    def __init__(self, net: EmulatedNetwork, index: int, reachable: bool, punch: bool = True):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        host = net.hosts[index]  # listens on its own address, announces the one others reach it at
        self.proc = net.popen([sys.executable, "-c", TRANSPORT_HOST, host.local_address, host.address,
                               str(int(reachable)), str(int(punch))], index, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.endpoint, self.peer_id = self._line(30).split()

    def _line(self, timeout: float) -> str:
        ready = select.select([self.proc.stdout], [], [], timeout)[0]
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"the transport host did not answer (exit code {self.proc.poll()})"
        return line.strip()

    def __call__(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(40))


@pytest.mark.parametrize("kind", ["cone", "symmetric"])
def test_two_ranks_behind_nat_punch_through_to_each_other_or_have_their_bytes_relayed(delay_line_ok, kind):
    """Hosts 1 and 2 behind NAT, host 0 reachable.  Behind NATs that keep a connection's port (``cone``), 1's
    message to 2 goes straight through both NATs (a simultaneous open): host 0 passes on only the request to dial
    back, not the payload.  Behind NATs that give each destination its own port, the punch fails and host 0
    relays the payload, which still arrives whole."""
    size = 1 << 20
    with _net(3, rate="50mbit", rtt_ms=20, nat=(1, 2), nat_kind=kind) as net:
        public, first, second = (_TransportHost(net, i, reachable=i == 0) for i in range(3))
        assert first.endpoint.startswith("punch:") and second.endpoint.startswith("punch:")
        for hidden in (first, second):
            hidden(reach=[public.endpoint])
        assert first(send=second.endpoint, key="part", size=size) == {"ok": True}
        assert second(recv="part", sender=first.peer_id) == {"size": size, "intact": True}
        relay = public(stats=1)
        print(f"{kind} NAT: the reachable host passed on {relay['relayed']} message(s), {relay['sent']} bytes")
        if kind == "cone":
            assert relay["relayed"] >= 1 and relay["sent"] < size // 100  # the requests to dial back, only
        else:
            assert relay["sent"] >= size  # the payload itself, after the punch failed
        # an island whose punch failed has its next groups average through the reachable islands
        assert first(stats=1)["punch_failed"] == (kind == "symmetric")


def _forwarder_gone(pid: int) -> bool:
    return wait_until(lambda: not is_running(pid), timeout=10, every=0.05)


def _ns_of(base: str) -> list[str]:
    return [n for n in list_namespaces(base) if n.startswith(f"{base}-")]


def test_close_leaves_nothing(delay_line_ok):
    net = _net(2, rate="20mbit", rtt_ms=10, loss=0.01)
    pid = net.forwarder.pid
    assert is_running(pid)
    assert sorted(_ns_of(net.base)) == sorted(net.namespaces)
    sleeper = net.popen(["sleep", "60"], 0)
    net.close()
    assert _ns_of(net.base) == []
    assert _forwarder_gone(pid)
    assert sleeper.poll() is not None


OWNER = textwrap.dedent(
    """
    import json, sys, time
    from experiments.netns import EmulatedNetwork
    net = EmulatedNetwork(2, rate="20mbit", rtt_ms=10, run_id=sys.argv[1], delay_line=True)
    print(json.dumps({"base": net.base, "forwarder": net.forwarder.pid}), flush=True)
    time.sleep(60)
    """
)


def test_killed_owner_leaves_nothing_after_cleanup_stale(delay_line_ok):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rid = f"k{os.getpid()}{secrets.token_hex(2)}"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, rid], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        info = json.loads(owner.stdout.readline())
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        owner.stdout.close()
    assert _ns_of(info["base"]), "SIGKILL cannot clean up; the namespaces remain until cleanup_stale"
    assert sorted(cleanup_stale(info["base"])) == sorted(f"{info['base']}-{x}" for x in ("hub", "h0", "h1"))
    assert _ns_of(info["base"]) == []
    assert _forwarder_gone(info["forwarder"])


def test_an_island_behind_nat_that_did_not_say_so_finds_it_out_and_trains(delay_line_ok, tmp_path):
    """Island 1's host takes no incoming connection and its command has no ``--averaging.client_mode``: the
    reachable island cannot connect back to it, so it takes part through lanes; every round commits on both and
    θ_global ends identical (before the dial-back, every round of such a run failed)."""
    from experiments.nat import run_arm
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path / "unused", **{
        "diloco.outer_steps": 2, "diloco.inner_steps": 4, "averaging.backend": "hivemind",
        "averaging.min_group_size": 2, "averaging.matchmaking_time": 2.0, "averaging.request_timeout": 1.0,
        "averaging.matchmaking_timeout": 60.0, "averaging.startup_timeout": 30.0})
    r = run_arm(cfg, 2, (1,), "50mbit", 10.0, tmp_path / "runs", declared=False)
    assert r["behind_nat"] == [False, True] and r["found_by_dial_back"] == [False, True], r
    assert r["rounds_committed"] == [2, 2] and r["theta_identical"], r
    log = (tmp_path / "runs" / "island1" / "train.log").read_text()
    assert "no island of the run could connect to" in log and "taking part behind NAT" in log


def test_two_islands_that_declared_themselves_behind_nat_learn_their_public_address_and_punch_through(
        delay_line_ok, tmp_path):
    """Islands 1 and 2 behind cone NATs that rewrite their private addresses, started with
    ``--averaging.client_mode true`` and no announced address: each asks the reachable island where it sees it
    from, announces that (its NAT's public address) and so punches through to the other; every round commits on
    all three and θ_global ends identical.  Announcing its private address instead, as before, no punch could
    reach it."""
    from experiments.nat import run_arm
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path / "unused", **{
        "diloco.outer_steps": 2, "diloco.inner_steps": 4, "averaging.backend": "hivemind",
        "averaging.min_group_size": 3, "averaging.matchmaking_time": 2.0, "averaging.request_timeout": 1.0,
        "averaging.matchmaking_timeout": 60.0, "averaging.startup_timeout": 30.0})
    r = run_arm(cfg, 3, (1, 2), "50mbit", 10.0, tmp_path / "runs", declared=True)
    assert r["rounds_committed"] == [2, 2, 2] and r["theta_identical"], r
    for i in (1, 2):
        log = (tmp_path / "runs" / f"island{i}" / "train.log").read_text()
        assert "through both NATs" not in log, log[-3000:]  # no punch failed
        assert f"the run's reachable islands see this one at 10.77.0.{i + 1}" in log, log[-3000:]
        assert "join with --initial-peers" not in log  # its own address is no way into the run

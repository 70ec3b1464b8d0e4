"""The ports an island needs: its DHT's and the next one (its transport's), one range a firewall opens; islands
sharing a server never collide; a port another listener holds is refused even where the kernel would share it;
and the README's two-server example, run as written between emulated hosts whose firewalls let in only the ports
it names."""

from __future__ import annotations

import errno
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from experiments.netns import EmulatedNetwork
from peers.settings import PORTS_PER_RANK, NetworkSettings, port_problems, transport_port
from tests.conftest import delay_line_network

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


# ------------------------------------------------------------------ the port plan (no network)


def test_the_transport_takes_the_port_after_the_dhts_and_islands_sharing_a_server_never_collide():
    from peers.node import _shift_port

    a = NetworkSettings(host_maddrs=["/ip4/0.0.0.0/tcp/31337"])
    assert transport_port(a) == 31338
    # islands of one torchrun world: each island's first rank shifts both of its ports by its local rank
    taken = []
    for local_rank in range(8):
        dht = int(_shift_port(a.host_maddrs[0], PORTS_PER_RANK * local_rank).rsplit("/", 1)[1])
        taken += [dht, transport_port(a, local_rank)]
        assert taken[-1] == dht + 1
    assert len(set(taken)) == len(taken) == 16 and max(taken) == 31337 + 15
    # a set port is the first island's, shifted alike; port 0 (tests, one machine) keeps both free ports
    assert [transport_port(NetworkSettings(host_maddrs=a.host_maddrs, transport_port=40000), r)
            for r in range(3)] == [40000, 40002, 40004]
    assert transport_port(NetworkSettings(host_maddrs=["/ip4/127.0.0.1/tcp/0"])) == 0


@pytest.mark.parametrize("settings, problem", [
    (NetworkSettings(host_maddrs=["/ip4/0.0.0.0/tcp/31337"], transport_port=31337),
     "--averaging.transport_port 31337 is the DHT's port"),
    (NetworkSettings(transport_port=70000), "--averaging.transport_port must be a TCP port"),
    (NetworkSettings(host_maddrs=["/ip4/0.0.0.0/tcp/65535"]), "leaves no next port for the transport"),
])
def test_ports_that_cannot_work_are_one_sentence(settings, problem):
    problems = port_problems(settings)
    assert len(problems) == 1 and problem in problems[0]
    assert port_problems(NetworkSettings(host_maddrs=["/ip4/0.0.0.0/tcp/31337"])) == []


def test_a_port_the_dhts_daemon_holds_is_refused_though_it_lets_others_share_it(no_leaked_daemons):
    """hivemind's p2pd listens with SO_REUSEPORT: a transport that punches holes (and so shares its own port) would
    bind the DHT's port too and take a share of the DHT's connections.  It is refused instead."""
    from diloco.launch.simulate import free_port_pair
    from peers.discovery.dht import start_dht
    from peers.identity import Identity
    from peers.wire.transport import Transport

    port = free_port_pair("127.0.0.1")
    dht = start_dht(NetworkSettings(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], startup_timeout=15))
    try:
        with pytest.raises(OSError) as taken:
            Transport(Identity.generate(), "key", host="127.0.0.1", port=port, punch=True)
        assert taken.value.errno == errno.EADDRINUSE
        free = Transport(Identity.generate(), "key", host="127.0.0.1", port=port + 1, punch=True)
        free.close()
    finally:
        dht.shutdown()


# ------------------------------------------------------------------ emulated hosts behind firewalls


def _net(n_hosts: int = 2, **kwargs) -> EmulatedNetwork:
    return delay_line_network("p", n_hosts, **kwargs)


LISTEN_ON = r"""
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2]))); s.settimeout(20)
print("ready", flush=True)
c, _ = s.accept(); c.sendall(b"ok"); c.close()
"""


@pytest.mark.parametrize("firewall, problem", [({2: (80,)}, "firewall must map host indices in 0..1"),
                                               ({0: (0,)}, "firewall must list TCP ports in 1..65535")])
def test_a_firewall_that_names_no_host_or_no_port_is_one_sentence(firewall, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        EmulatedNetwork(2, firewall=firewall)


def test_a_firewall_lets_new_connections_in_on_its_open_ports_only(delay_line_ok):
    open_port = 31338
    with _net(2, rate="50mbit", firewall={1: (open_port,)}) as net:
        assert not net.can_reach(0, 1, timeout=1.5), "a closed port must not take a connection"
        assert net.can_reach(1, 0), "the firewalled host connects out, and the replies come back in"
        listener = net.popen([sys.executable, "-c", LISTEN_ON, net.hosts[1].address, str(open_port)], 1,
                             stdout=subprocess.PIPE, text=True)
        try:
            assert select.select([listener.stdout], [], [], 15)[0] and listener.stdout.readline().strip() == "ready"
            dial = subprocess.run(net.wrap([sys.executable, "-c", "import socket, sys; c = socket.create_connection("
                                            "(sys.argv[1], int(sys.argv[2])), timeout=5); assert c.recv(2) == b'ok'",
                                            net.hosts[1].address, str(open_port)], 0),
                                  capture_output=True, text=True, timeout=30)
            assert dial.returncode == 0, dial.stderr[-1000:]
        finally:
            net.reap(listener)


def readme_servers() -> tuple[list[list[str]], tuple[int, ...]]:
    """The README's multi-server example: each server's ``diloco train`` command (its words after ``diloco``) and
    the TCP ports its comment says the firewall lets in."""
    section = README.read_text().split("### Several islands across servers", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)[1]
    low, high = map(int, re.search(r"TCP ports (\d+)-(\d+)", block).groups())
    commands = [shlex.split(line)[1:] for line in block.replace("\\\n", " ").splitlines()
                if line.startswith("diloco train")]
    return commands, tuple(range(low, high + 1))


SHORT_RUN = ["--model.preset", "tiny", "--diloco.inner_steps", "4", "--diloco.outer_steps", "2",
             "--inner.batch_size", "4", "--inner.warmup_steps", "2", "--logging.eval_batches", "2",
             "--logging.samples", "0", "--checkpoint.every", "0", "--wandb.mode", "disabled", "--threads", "1",
             "--data.max_bytes", "2000000", "--averaging.wait_for_islands", "2",
             "--averaging.matchmaking_time", "2", "--averaging.request_timeout", "1",
             "--averaging.matchmaking_timeout", "120", "--averaging.startup_timeout", "60"]
"""What makes the README's commands a short run of the tiny model, both islands at the first round (the first
waits for the second, whose cold start takes a minute and more on a loaded 2-core machine)."""


class _Island:
    """One ``diloco train`` in an emulated host, its stdout read as it comes."""

    def __init__(self, net: EmulatedNetwork, host: int, args: list[str], run_dir: Path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", WANDB_MODE="disabled")
        self.run_dir = run_dir
        self.proc = net.popen([sys.executable, "-m", "diloco.cli", *args, *SHORT_RUN, "--logging.run_dir",
                               str(run_dir)], host, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=REPO)
        self.lines: list[str] = []
        self.joined = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "join with --initial-peers" in line:
                self.joined.set()
        self.joined.set()

    def join_line(self, timeout: float) -> str:
        self.joined.wait(timeout)
        found = [line for line in self.lines if "join with --initial-peers" in line]
        assert found, f"the first island printed no join line:\n{self.tail()}"
        return found[0]

    def finish(self, timeout: float) -> int | None:
        """The exit code, once it ends (None if it runs past ``timeout`` seconds)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def tail(self) -> str:
        return "".join(self.lines[-80:])


def _given(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with the value after ``flag`` replaced by ``value``."""
    i = args.index(flag)
    return args[:i + 1] + [value] + args[i + 2:]


def test_the_readme_servers_run_as_written_behind_firewalls_that_open_only_the_ports_it_names(
        delay_line_ok, tmp_path, no_leaked_daemons):
    """Server A and server B each take the README's command (made a short run of the tiny model) in an emulated
    host whose firewall lets in new TCP connections only on the ports the README names.  A's join line names those
    ports; B, joining with what A printed, is reachable through them (it does not fall back to taking part behind
    NAT), and both islands commit every round to the same θ_global.  With the transport on a free port, as before,
    no island could reach the other's transport through these firewalls."""
    (first, second), ports = readme_servers()
    assert ports == (31337, 31338) and "/tcp/31337" in " ".join(first)
    with _net(2, rate="100mbit", firewall={0: ports, 1: ports}) as net:
        assert not net.can_reach(1, 0, timeout=1.5), "the firewall must shut the ports it does not name"
        public = net.hosts[0].address
        a = _Island(net, 0, [w.replace("203.0.113.5", public) for w in first], tmp_path / "A")
        line = a.join_line(timeout=180)
        assert f"connect to TCP ports {ports[0]} (DHT) and {ports[1]} (transport) here" in line, line
        peers, key_file = re.search(r"--initial-peers (\S+) --averaging\.run_key_file FILE, FILE a copy of (\S+)",
                                    line).groups()
        assert peers.startswith(f"/ip4/{public}/tcp/{ports[0]}/p2p/")
        copy = tmp_path / "B.run.key"  # server B's copy of A's key file (scp -p keeps its mode)
        shutil.copy2(key_file, copy)
        b = _Island(net, 1, _given(_given(second, "--initial-peers", peers), "--averaging.run_key_file", str(copy)),
                    tmp_path / "B")
        codes = [island.finish(timeout=400) for island in (a, b)]
        assert codes == [0, 0], f"exit codes {codes}\n--- A:\n{a.tail()}\n--- B:\n{b.tail()}"
    done = [a.summary(), b.summary()]
    assert [s["rounds_ok"] for s in done] == [2, 2], [s.get("failures") for s in done]
    assert done[0]["theta_checksum"] == done[1]["theta_checksum"]
    assert not done[1]["behind_nat"], "B's ports were open: it must be reachable, not behind NAT"


def test_the_dial_back_frees_the_transports_port_before_the_transport_listens_there():
    """A joining island asks to be dialed back on the port its transport takes next: its stand-in listener must be
    gone by then (a socket closed while a thread waits in accept() would go on listening)."""
    from diloco.launch.simulate import free_port_pair
    from peers.wire.dial_back import ask_dial_back
    from peers.identity import Identity
    from peers.wire.transport import Transport

    port = free_port_pair("127.0.0.1") + 1
    identity = Identity.generate()
    assert ask_dial_back(identity, "key", True, [], "127.0.0.1", port, "127.0.0.1", []).reached is None
    Transport(identity, "key", host="127.0.0.1", port=port, punch=True).close()

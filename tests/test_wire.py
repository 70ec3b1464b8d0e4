"""The kernel's byte counts of TCP connections (peers.wire.counters) on real loopback sockets."""

import os
import socket
import subprocess
import sys
import time

from peers.proctable import process_sockets, socket_files
from peers.wire.counters import WireCounter, daemons


def _pair() -> tuple[socket.socket, socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    server.close()
    return client, conn


def _recv_all(sock: socket.socket, n: int) -> None:
    while n:
        n -= len(sock.recv(min(n, 1 << 16)))


def test_counts_what_was_sent_with_headers_and_keeps_closed_connections():
    wire = WireCounter(own=True)
    wire.take()  # whatever this process's sockets moved before
    client, conn = _pair()
    payload = 3_000_000
    client.sendall(b"x" * payload)
    _recv_all(conn, payload)
    got = wire.take()
    # both ends are ours: each byte is counted once sent and once received, plus each segment's headers
    assert payload < got.sent < 1.1 * payload + 10_000, got
    assert payload < got.received < 1.1 * payload + 10_000, got
    client.close()
    conn.close()
    assert wire.take().sent >= 0  # a closed connection keeps the counts of its last reading


def test_finds_daemons_by_name_among_descendants_and_their_sockets():
    child = subprocess.Popen([sys.executable, "-c", "import socket, subprocess, sys\n"
                              "s = socket.socket()\n"
                              "p = subprocess.Popen(['sleep', '30'])\n"
                              "print(p.pid, flush=True)\n"
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert daemons(os.getpid(), "sleep") == [grandchild]
        assert daemons(os.getpid(), "p2pd") == []
        assert process_sockets([child.pid]), "the child's socket is seen"
        assert not process_sockets([grandchild])
    finally:
        child.stdin.close()
        child.wait(timeout=10)
        subprocess.run(["kill", str(grandchild)], check=False)


def test_a_daemon_counts_its_own_connections_not_those_it_inherited_from_this_process(tmp_path):
    """A DHT's daemon forked after this process opened its process group's connections holds them too: their
    bytes are this process's (in-server traffic), not the daemon's, and must not count as slow-link bytes."""
    daemon_exe = tmp_path / "p2pd"
    daemon_exe.symlink_to("/bin/sleep")
    inherited, inherited_peer = _pair()  # stands for a gloo connection: both the daemon and we hold one end
    theirs, theirs_peer = _pair()  # one only the daemon holds (we keep the far end, as a peer would)
    daemon = subprocess.Popen([str(daemon_exe), "30"], pass_fds=[inherited.fileno(), theirs.fileno()])
    try:
        theirs.close()
        assert daemons(os.getpid()) == [daemon.pid]
        wire = WireCounter(sample_every=0)
        wire.take()
        payload = 2_000_000
        inherited.sendall(b"x" * payload)
        _recv_all(inherited_peer, payload)
        theirs_peer.sendall(b"y" * 50_000)  # less than a receive window: the daemon (sleep) reads nothing
        time.sleep(0.2)
        got = wire.take()
        assert got.sent < payload / 10, got  # what we sent on the inherited connection is not the daemon's
        assert 50_000 <= got.received < payload / 10, got  # what reached the daemon's own one is
    finally:
        daemon.kill()
        daemon.wait(timeout=10)
        for s in (inherited, inherited_peer, theirs_peer):
            s.close()


def test_the_socket_files_of_processes_are_found_to_be_removed_after_a_sigkill(tmp_path):
    """A process killed with SIGKILL leaves the files of the Unix sockets it bound (hivemind's daemon and its
    clients put theirs in /tmp): the launcher finds them by the process's descriptors before the kill."""
    path = tmp_path / "daemon.sock"
    child = subprocess.Popen([sys.executable, "-c", "import socket, sys\n"
                              f"s = socket.socket(socket.AF_UNIX); s.bind({str(path)!r}); s.listen()\n"
                              "print('ready', flush=True)\n"
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert socket_files([child.pid], under=str(tmp_path)) == {str(path)}
        assert socket_files([os.getpid()], under=str(tmp_path)) == set()
    finally:
        child.kill()
        child.wait(timeout=10)
    assert path.exists()  # SIGKILL left it behind: the launcher removes what it found

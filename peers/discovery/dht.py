"""Starting and joining the peer-to-peer network (hivemind's DHT) with errors a person can act on."""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from peers.discovery.owned import OwnedRecords
from peers.discovery.run_key import RunKeyValidator
from peers.errors import PeerNetworkError, PortTakenError
from peers.settings import NetworkSettings

log = logging.getLogger(__name__)


def check_multiaddr(addr: str, what: str, need_peer_id: bool = False) -> None:
    """Raise PeerNetworkError naming ``what`` if ``addr`` is not a parseable multiaddr."""
    try:
        parsed = Multiaddr(addr)
    except Exception as e:  # multiaddr raises several exception types for malformed input
        raise PeerNetworkError(
            f"{what} {addr!r} is not a valid multiaddr ({e}); it should look like "
            f"/ip4/203.0.113.5/tcp/31337{'/p2p/PEER_ID' if need_peer_id else ''}") from None
    if need_peer_id and "p2p" not in [p.name for p in parsed.protocols()]:
        raise PeerNetworkError(
            f"{what} {addr!r} lacks its /p2p/PEER_ID suffix; copy the full address printed by the island you join")


@contextlib.contextmanager
def signals_ignored_by_children():
    """Start helper processes with SIGINT ignored.

    Ctrl-C in a terminal reaches the whole process group; the island's own handler then finishes
    the round and checkpoints, which needs its DHT and averager processes alive.  They are stopped
    by the island's ``shutdown`` calls instead (SIGTERM still ends them, as hivemind's shutdown
    relies on ``terminate()``).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def mute_shutdown_noise() -> None:
    """Send the tracebacks of hivemind's helpers dying on a gone socket to the debug log, for good: call
    it once the process is leaving.

    Ctrl-C reaches the whole process group, the p2p daemons too (they handle SIGINT themselves), so
    hivemind's averager thread and asyncio tasks fail on their way down on a daemon socket that is
    gone; what they print says nothing a user could act on, after the checkpoint is written."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    default = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if issubclass(args.exc_type, (OSError, EOFError)):
            log.debug("thread %s ended on shutdown: %r", getattr(args.thread, "name", "?"), args.exc_value)
        else:
            default(args)

    threading.excepthook = hook


def start_dht(settings: NetworkSettings, open_keys: tuple[str, ...] = ()) -> hivemind.DHT:
    """Start this island's DHT node and join ``settings.initial_peers``; in a private run (``settings.run_key``)
    every record is signed with the key, but for ``open_keys`` (see :class:`peers.discovery.run_key.RunKeyValidator`).

    Raises PeerNetworkError with one actionable sentence when an address is malformed, a port is
    taken or no initial peer answers within ``startup_timeout`` seconds.  Without ``settings.identity_path`` the
    node gets a fresh identity in a private folder removed when this process exits: every node's key is in a
    file, which its rank's transport proves the same peer id with (:func:`peers.identity.identity_of`).
    """
    for addr in settings.initial_peers:
        check_multiaddr(addr, "initial peer", need_peer_id=True)
    for addr in settings.host_maddrs:
        check_multiaddr(addr, "listen address")
    for addr in settings.announce_maddrs:
        check_multiaddr(addr, "announce address")
    kwargs: dict = dict(
        host_maddrs=settings.host_maddrs,
        client_mode=settings.client_mode,
        startup_timeout=settings.startup_timeout,
        # hivemind's caches copy a key read or stored to more nodes, and every node holding the registry answers each
        # look-up passing it with all of it: at 32 islands they doubled what an island sent to wait for a group
        # (python -m benchmarks.registry_bytes); the registry's replicas hold every record without them, and a record
        # a read missed stays in what the reader saw until it expires (Membership.members)
        cache_locally=False, cache_nearest=0, cache_on_store=False,
    )
    kwargs["record_validators"] = [OwnedRecords()] + (
        [RunKeyValidator(settings.run_key, open_keys)] if settings.run_key else [])
    if settings.announce_maddrs:
        kwargs["announce_maddrs"] = settings.announce_maddrs
    if settings.identity_path:
        os.makedirs(os.path.dirname(os.path.abspath(settings.identity_path)), exist_ok=True)
        kwargs["identity_path"] = settings.identity_path
    else:  # hivemind writes a fresh key there (a name not taken yet: no check that the identity is free)
        kwargs["identity_path"] = os.path.join(_identities(), f"{secrets.token_hex(8)}.key")
    deadline = time.monotonic() + settings.startup_timeout
    tcp = [a for a in settings.initial_peers if _TCP.match(a)]
    while True:
        # an initial peer still starting: wait for its port rather than start (and drop) a daemon per try
        while tcp and time.monotonic() + 1.0 < deadline and not any(listens(a, timeout=0.5) for a in tcp):
            time.sleep(0.2)
        try:
            with signals_ignored_by_children():
                return hivemind.DHT(initial_peers=settings.initial_peers or None, start=True, await_ready=True,
                                    **dict(kwargs, startup_timeout=max(1.0, deadline - time.monotonic())))
        except Exception as e:
            error = e
        # a busy or just-restarted peer may refuse a first dial: retry until the deadline
        if not settings.initial_peers or time.monotonic() + 1.0 > deadline:
            break
        time.sleep(1.0)
    detail = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    if "address already in use" in str(error).lower():
        raise PortTakenError(f"could not listen on {', '.join(settings.host_maddrs)}: the port is in use; free it or "
                             f"pick another one [{detail}]")
    if settings.initial_peers:
        raise PeerNetworkError(
            f"could not reach any initial peer ({', '.join(settings.initial_peers)}) within "
            f"{settings.startup_timeout:.0f} s: check the address, that the island there is running and "
            f"that its port is open to you [{detail}]")
    raise PeerNetworkError(
        f"could not start the peer-to-peer node on {', '.join(settings.host_maddrs)}: is the port free "
        f"and the address local to this machine? [{detail}]")


_IDENTITIES: dict[int, str] = {}
IDENTITIES_PREFIX = "diloco-identities-"
"""The temporary folders of :func:`_identities`: ``diloco-identities-<pid>-<random>``."""


def _identities() -> str:
    """This process's private folder for the identities of DHT nodes started without one (removed when it exits;
    a forked child makes its own).  Folders of processes that died without removing theirs go first."""
    pid = os.getpid()
    if pid not in _IDENTITIES:
        sweep_identities()
        _IDENTITIES[pid] = folder = tempfile.mkdtemp(prefix=f"{IDENTITIES_PREFIX}{pid}-")
        atexit.register(lambda: os.getpid() == pid and shutil.rmtree(folder, ignore_errors=True))
    return _IDENTITIES[pid]


def sweep_identities(root: str | None = None) -> list[str]:
    """Remove the identity folders (:func:`_identities`) of this user's processes that are gone: a process killed by
    SIGKILL never runs its exit handlers, and its folder stayed behind (51 on this machine after a week of tests).
    Returns the folders removed."""
    removed = []
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), f"{IDENTITIES_PREFIX}*-*")):
        owner = os.path.basename(path)[len(IDENTITIES_PREFIX):].split("-", 1)[0]
        try:
            mine = os.stat(path).st_uid == os.getuid()
        except OSError:
            continue
        if owner.isdigit() and mine and not _alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def peer_id_of(identity_path: str) -> str:
    """The peer ID of the private key at ``identity_path``, written there first if there is none: with it and a
    port chosen in advance, an island's address is known before it starts, so the others can start at once."""
    if not os.path.isfile(identity_path):
        os.makedirs(os.path.dirname(os.path.abspath(identity_path)), exist_ok=True)
        hivemind.p2p.P2P.generate_identity(identity_path)
    with open(identity_path, "rb") as f:
        return str(hivemind.p2p.PeerID.from_identity(f.read()))


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """The full multiaddrs (with /p2p/PEER_ID) other islands can pass as initial peers."""
    return [str(a) for a in dht.get_visible_maddrs()]


_TCP = re.compile(r"/(?:ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)")


def tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    """(host, port) of a /ip4|ip6|dns*/HOST/tcp/PORT/... multiaddr; None for any other."""
    m = _TCP.match(maddr)
    return (m[1], int(m[2])) if m else None


def listens(maddr: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``maddr`` (/ip4|ip6|dns*/HOST/tcp/PORT/...): a cheap
    check before restarting a node to join it (a stopped process's port still accepts)."""
    endpoint = tcp_endpoint(maddr)
    if endpoint is None:
        return False
    try:
        socket.create_connection(endpoint, timeout=timeout).close()
        return True
    except OSError:
        return False


def tcp_port(dht: hivemind.DHT) -> int:
    """The TCP port ``dht`` listens on (0 if none)."""
    ports = [int(m[1]) for a in visible_maddrs(dht) if (m := re.search(r"/tcp/(\d+)", a))]
    return ports[0] if ports else 0

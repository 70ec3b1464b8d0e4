"""An island rank's place in the peer network: its DHT node, its averager, the run's member registry, the
run key, the traffic counters and the line other islands join with.

Every rank of an island runs its own hivemind DHT node (rank 0 joins the run's initial peers, the other
ranks bootstrap from it) and averages the buckets it owns over it; every rank registers its peer id in the
run's member registry under the island's id (rank 0's peer id), so private runs accept all of them and
islands are counted once.  A :class:`PeerNode` stays the same object across reconnects (an island alone in
the run restarts its node through the addresses it remembers), so that its users keep one handle.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hivemind
import torch

from peers.averaging.fallback import HierarchicalAllReduce
from peers.averaging.local import LocalAverager
from peers.averaging.protocol import IslandAverager
from peers.averaging.sharded import FeedbackBuffers, ShardedAverager
from peers.discovery.dht import (
    listens,
    start_dht,
    tcp_endpoint,
    tcp_port,
    visible_maddrs,
)
from peers.discovery.membership import Membership, reachable_islands
from peers.discovery.run_key import RunKey, check_run_key, keep_key_proof, key_check_key, obtain_run_key
from peers.errors import PeerNetworkError, PortTakenError, RunKeyError
from peers.island.exchange import BucketExchange
from peers.island.layout import CanonicalLayout
from peers.island.ranks import IslandRanks
from peers.settings import PORTS_PER_RANK, NetworkSettings, PeerSettings, Scope, transport_port
from peers.wire.counters import Traffic, WireCounter
from peers.wire.dial_back import Reachability, ask_dial_back, serve_dial_back
from peers.identity import identity_of
from peers.wire.state_share import Provider, StateServer
from peers.wire.transport import Transport, message_limit, refuses

log = logging.getLogger("diloco")  # the trainer's log: the island speaks with one voice

KNOWN_PEERS = "known_peers.txt"
"""In the run dir: multiaddrs of the live islands this island last saw, so that after a restart it finds
the run again even when the island it first joined through is gone (or is the one restarting)."""
IDENTITY = "identity.key"
"""In the run dir, unless ``--averaging.identity_path`` says where: the island's private key, so that its
peer id, like its port (``PORT``), stays the same across restarts and the addresses other islands
remember of it stay valid."""
PORT = "port"
"""In the run dir, ``port.rank<r>``: the TCP port rank ``r`` listened on when configured with port 0; an
island resumed with ``--resume`` listens there again (a free port if it is taken)."""
RUN_KEY = "run.key"
"""In the run dir (mode 600), unless ``--averaging.run_key_file`` says where: the run key, generated there by the
first island of a private run, or kept there when given on the command line or in the environment, so that an
island restarted with its original command plus ``--resume`` rejoins its own run (see
:func:`peers.discovery.run_key.obtain_run_key`); the join line names the file to copy to other servers."""
MAX_KNOWN_PEERS = 64


def is_peer_file(name: str) -> bool:
    """Whether a run dir's file of this ``name`` is one the peer node writes when it starts (its identity,
    ports, run key, known peers): what an island that failed to start removes again, when it made them."""
    return name in (IDENTITY, RUN_KEY, KNOWN_PEERS) or name.startswith(PORT + ".")


def round_id(rnd: int, retry: bool = False) -> str:
    """The averaging round id of outer step ``rnd``: the step, or ``"<step>.retry"`` when the members left
    average it again after losing one."""
    return f"{rnd}.retry" if retry else str(rnd)


def round_of(rid: str) -> int:
    """The outer step of a round id made by :func:`round_id`."""
    return int(rid.split(".")[0])


class PeerNode:
    """This rank's peer network handles (collective where it says so).

    :meth:`start` starts the DHT node: a process forked from this one, so it starts before the model exists (a
    process forked later keeps a copy of every page this one writes afterwards: the parameters, the optimizer
    states, θ_global, round after round).  :meth:`bind` gives the shards this rank averages (``layout``,
    ``params``, ``specs``, ``exchange``), :meth:`serve` what it serves to joiners, and :meth:`connect` wires the
    rest.  ``unsent``: the codec's error feedback dicts the averager keeps (``feedback`` and ``carry``, updated in
    place); ``count(traffic)`` receives the island's traffic since the last count (:meth:`count_bytes`);
    ``resuming``: the island was started with ``--resume`` (it listens on its former ports and rejoins the run it
    knew)."""

    def __init__(self, a: PeerSettings, rt: IslandRanks, run_dir: Path, name: str, *, resuming: bool,
                 unsent: FeedbackBuffers, count: Callable[[Traffic], None]):
        self.a, self.rt, self.run_dir, self.name, self.resuming = a, rt, run_dir, name, resuming
        self.layout: CanonicalLayout | None = None
        self.params: Mapping[str, torch.Tensor] = {}
        self.specs: Mapping[str, Any] = {}
        self.exchange: BucketExchange | None = None
        self.unsent, self.count = unsent, count
        self.run_key: RunKey | None = None
        """This island's run key and its file, once :meth:`start` found it (None in a public or local run)."""
        self.dht: hivemind.DHT | None = None
        self.averager: IslandAverager | None = None
        """The island's averager once connected (None before :meth:`connect` and after :meth:`disconnect`)."""
        self.membership: Membership | None = None
        self.fallback: HierarchicalAllReduce | None = None
        self.wire: WireCounter | None = None
        self.alone = AloneWatch(a.rejoin_after)
        self._committed: dict[str, Any] = {"committed": [], "strikes": {}}
        """The committed roster and strikes while no averager holds them (before :meth:`connect`, across
        reconnects)."""
        self.transport: Transport | None = None
        """Where this rank takes a round's bytes and requests for state (:mod:`peers.wire.transport`)."""
        self.behind_nat = False
        """Whether the islands asked could not connect back to this one (on rank 0; then the island takes part
        as ``--averaging.client_mode true`` would)."""
        self.seen_ip = ""
        """The address the islands asked saw this one's question come from (its NAT's, behind one)."""
        self._server: StateServer | None = None
        self._remembering = threading.Lock()
        self._provide: Provider = lambda: None
        self._lock = threading.Lock()
        self._connected: Callable[[], None] = lambda: None
        self._stopping: Callable[[], bool] = lambda: False

    def serve(self, provide: Provider, lock: threading.Lock, connected: Callable[[], None],
              stopping: Callable[[], bool]) -> None:
        """``provide()``: what this rank serves to joiners, read with ``lock`` held (see
        :class:`peers.wire.state_share.StateServer`); ``connected()``: called on every rank after each
        (re)connection; ``stopping()``: whether this process is leaving."""
        self._provide, self._lock, self._connected, self._stopping = provide, lock, connected, stopping

    def bind(self, layout: CanonicalLayout, params: Mapping[str, torch.Tensor], specs: Mapping[str, Any],
             exchange: BucketExchange) -> None:
        """The shards this rank averages: the run's layout, this rank's parameters and their specs, the island's
        exchange."""
        self.layout, self.params, self.specs, self.exchange = layout, params, specs, exchange

    # ---------------------------------------------------------------------------------- connect
    def start(self, rejoin: list[str] | None = None) -> None:
        """Collective: start this rank's DHT node (the run key resolved and checked first).  ``rejoin``: addresses of islands to reach (besides the initial peers)
        when this island, alone in the run, restarts its peer node (see :class:`AloneWatch`); each rank
        listens on its former port (``PORT``) whenever it rejoins or resumes."""
        a, rt = self.a, self.rt
        if a.backend == "local" or self.dht is not None:
            return
        resuming = self.resuming or rejoin is not None
        if rt.is_main and not resuming:
            (self.run_dir / KNOWN_PEERS).unlink(missing_ok=True)  # addresses of an earlier run, not this one
        if self.run_key is None and not a.public:
            self.run_key = self._obtain_run_key(resuming)
        run_key = self.run_key.key if self.run_key is not None else ""
        if a.backend != "torch":
            known = rejoin if rejoin is not None else remembered(self.run_dir, KNOWN_PEERS).split() if resuming else []
            port_file = f"{PORT}.rank{_local_rank(rt)}"
            former = int(remembered(self.run_dir, port_file) or 0) if resuming else 0
            # a resuming island whose peers are all down (restarting too) starts alone and keeps trying them
            try:
                self.dht = self._start_dht(run_key, known, alone_ok=resuming, port=former)
            except PortTakenError:
                if not former:
                    raise
                log.warning("could not listen on port %d as before; listening on a free port", former)
                self.dht = self._start_dht(run_key, known, alone_ok=resuming)
            remember(self.run_dir, port_file, f"{tcp_port(self.dht)}\n")
            self.wire = WireCounter(root=self.dht.pid)
            if not a.public:
                problem = rt.bcast(check_run_key(self.dht, a.run_id, run_key, a.startup_timeout) if rt.is_main else "")
                if problem:
                    self.dht.shutdown()
                    self.dht = None
                    raise RunKeyError(problem)
                if rt.is_main:
                    keep_key_proof(self.dht, a.run_id, run_key)

    def _obtain_run_key(self, resuming: bool) -> RunKey:
        """Collective over the world: the run key, found (or, on the first island of a run, generated) once by the
        world's rank 0 and handed to every rank (see :func:`peers.discovery.run_key.obtain_run_key`), so that its
        file is read, its warnings logged and a weak key stretched once.  ``resuming``: also read the key this
        island kept in its run dir."""
        a, rt = self.a, self.rt
        found, error = None, ""
        if rt.global_rank == 0:
            try:
                found = obtain_run_key(a.run_key, a.run_key_file, self.run_dir / RUN_KEY, a.run_id,
                                       read_default=resuming, first=not a.initial_peers)
            except RunKeyError as e:
                error = str(e)
        found, error = rt.bcast((found, error), world=True)
        if error:
            raise RunKeyError(error)
        return found

    def _scope(self) -> Scope:
        a = self.a
        return Scope(prefix=a.run_id, private=not a.public, client_mode=a.client_mode)

    def connect(self, rejoin: list[str] | None = None) -> None:
        """Collective: start this rank's peer node if :meth:`start` did not, then its averager and transport;
        register in the run; rank 0 prints how other islands join (see :meth:`start` for ``rejoin``)."""
        a, rt = self.a, self.rt
        if a.backend == "local":
            self.averager = LocalAverager()
            return
        self.start(rejoin)
        run_key = self.run_key.key if self.run_key is not None else ""
        group = rt.group
        if a.backend in ("torch", "auto") and rt.n_islands > 1:
            self.fallback = HierarchicalAllReduce(self.layout, self.params, self.specs, rt.island_ranks(),
                                                  min_group_size=a.min_group_size, control=rt.world_ctrl,
                                                  timeout=datetime.timedelta(seconds=rt.timeout_s))
            group = self.fallback.island_group
        if self.dht is not None:
            self.transport = self._start_transport(run_key)
            self.wire.extra = self.transport.socket_inodes
        ids = rt.gather_all(str(self.dht.peer_id) if self.dht is not None else f"{a.run_id}-island{rt.island_index}")
        backend = a.backend if self.fallback is not None or a.backend == "hivemind" else "hivemind"
        membership = None
        if self.dht is not None:
            membership = Membership(self.dht, a.run_id, ttl=a.member_ttl, island=ids[0], rank=rt.rank)
            membership.maddrs = [] if self._dht_client() else visible_maddrs(self.dht)
            membership.endpoint = self.transport.endpoint
        self.averager = ShardedAverager(
            self.layout, self.params, self.specs, group, self.dht, a, self._scope(), backend=backend,
            fallback=self.fallback, transport=self.transport, island_id=ids[0],
            exchange=self.exchange if group is rt.group else None, feedback=self.unsent.feedback,
            carry=self.unsent.carry, membership=membership)
        self.averager.committed, self.averager.strikes = self._committed["committed"], self._committed["strikes"]
        if membership is None:
            return
        self._server = StateServer(self.transport, self.averager.exchange, self._provide, self._lock)
        self.membership = membership
        self.membership.start_heartbeat()
        if not self.transport.reachable:
            threading.Thread(target=self._hold_lanes, args=(self.membership, self.transport), name="lanes",
                             daemon=True).start()
        self.membership.refuses = refuses
        self.averager.watch_rounds(lambda rid: self.membership.moved_past(round_of(rid)), self._stopping,
                                   self.membership.company)
        self._connected()
        if rt.is_main:
            announce_join(self.name, self.dht, a, self.run_key, reachable=self.transport.reachable,
                          round_port=self.transport.port)

    def rejoin_if_alone(self, main_decides: Callable[[Callable[[], Any]], Any], stuck: bool = False) -> None:
        """Collective: an island cut off from live islands it knew restarts its peer node through their addresses,
        from time to time (see :class:`AloneWatch`): alone, or, while its rounds keep failing (``stuck``), apart
        from islands of its committed roster.  Only a stuck island looks for the missing part of the run: one
        whose rounds commit has its majority, and on a loaded machine records can fall silent for a while without
        any split (restarting then would only make it worse)."""
        committed = self.averager.committed if self.averager is not None and stuck else []
        known = main_decides(lambda: self.alone.due(self.membership, remembered(self.run_dir, KNOWN_PEERS).split(),
                                                    committed))
        if known:
            self.count_bytes(0, 0, through_torch=False)  # the daemon's counts go with it
            self.disconnect()
            self.connect(rejoin=known)

    def _hold_lanes(self, membership: Membership, transport: Transport) -> None:
        """An island behind NAT: keep a lane open to every reachable rank of the run while connected, so that
        any of them can reach it first (a joiner downloading θ_global from it, say), not only the members of
        a round's group it has dealt with."""
        while self.membership is membership and not self._stopping():
            transport.reach([m.endpoint for m in membership.members().values()
                             if m.reachable() and m.island != membership.island])
            time.sleep(membership.period)

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the peer node: the run's committed roster that θ_global descends from (a round
        counts only for a majority of it, see :func:`peers.group.roster.quorum_problem`) and the strikes it holds
        against members."""
        if self.averager is None:
            return {"committed": list(self._committed["committed"]), "strikes": dict(self._committed["strikes"])}
        return {"committed": list(self.averager.committed), "strikes": dict(self.averager.strikes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (an island resumed with the θ_global of its checkpoint takes its roster too)."""
        self._committed = {"committed": [str(i) for i in state.get("committed", [])],
                           "strikes": {str(i): int(n) for i, n in dict(state.get("strikes", {})).items()}}
        if self.averager is not None:
            self.averager.committed, self.averager.strikes = self._committed["committed"], self._committed["strikes"]

    def disconnect(self) -> None:
        """Announce leaving, stop the averagers and the DHT (idempotent)."""
        if self.membership is not None:
            self.membership.leave()
            self.membership = None
        if self.averager is not None:
            self._committed = self.state_dict()  # a reconnect goes on from the same roster and strikes
            self.averager.shutdown()
            self.averager = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.wire is not None:
            self.wire.close()
        self.fallback = self.wire = None

    # ------------------------------------------------------------------------------------ traffic
    def count_bytes(self, payload_sent: int, payload_received: int, through_torch: bool) -> None:
        """Collective: hand the slow-link traffic since the last count, summed over the island's ranks, to ``count``.

        ``bytes_*``: what the kernel counted on the connections of the ranks' DHT daemons (all of hivemind's
        traffic: parts, votes, DHT records, state downloads; headers included).  A round that went through
        torch.distributed (or a machine where the kernel cannot tell) adds the payload the exchange computed
        instead.  ``payload_bytes_*``: the all-reduce payload alone."""
        wire = self.wire.take() if self.wire is not None else None
        sent, received = (wire.sent, wire.received) if wire is not None else (0, 0)
        if wire is None or through_torch:
            sent, received = sent + payload_sent, received + payload_received
        totals = self.rt.reduce([float(sent), float(received), float(payload_sent), float(payload_received)])
        self.count(Traffic(*(int(t) for t in totals)))

    def remember_peers(self, wait: bool = True) -> None:
        """Rank 0 keeps the addresses of the run's other islands in the run dir (after every round): the live
        ones first, then those it knew before that are not registered right now (restarting, most likely:
        an island comes back on the same port with the same peer id), one address per peer id.  ``wait`` False: in
        a thread of its own (it reads the registry)."""
        if not self.rt.is_main or self.membership is None:
            return
        if not wait:
            threading.Thread(target=self._remember_quietly, name="diloco-remember", daemon=True).start()
            return
        live = self.membership.addresses()
        if not live:
            return
        merged, seen = [], set()
        for address in live + remembered(self.run_dir, KNOWN_PEERS).split():
            peer = address.rsplit("/p2p/", 1)[-1]
            if peer not in seen or address in live:
                seen.add(peer)
                merged.append(address)
        remember(self.run_dir, KNOWN_PEERS, "\n".join(dict.fromkeys(merged[:MAX_KNOWN_PEERS])) + "\n")

    def _remember_quietly(self) -> None:
        """:meth:`remember_peers`, in a thread the peer node may outlive (it disconnects meanwhile); skipped while the
        last round's is still at it (both would write one file)."""
        if not self._remembering.acquire(blocking=False):
            return
        try:
            self.remember_peers()
        except Exception as e:
            log.debug("could not keep the run's addresses: %s", e)
        finally:
            self._remembering.release()

    def _start_transport(self, run_key: str) -> Transport:
        """Collective: this island's transports, one port for the server: rank 0 listens on the address the DHT
        listens on, at :func:`transport_port` (the DHT's port + 1 unless ``transport_port`` says otherwise),
        announced at the announced address when there is one; the other ranks take the connections for them
        from rank 0 (see :mod:`peers.wire.transport`)."""
        a, rt = self.a, self.rt
        host = _listen_ip(a)
        transport, advertise, error = None, "", ""
        if rt.is_main:
            # behind NAT, hole punching aims at the announced address: the NAT's, as the dial-back saw it
            advertise = (self.seen_ip if a.client_mode and not _ip_of(a.announce_maddrs) else ""
                         ) or _advertised_ip(a, self.dht)
            port = transport_port(a, _local_rank(rt))
            try:
                transport = Transport(identity_of(self.dht), run_key, host=host, port=port,
                                      advertise=advertise, encrypt=a.encrypt, reachable=not a.client_mode,
                                      punch=a.hole_punch, max_message=message_limit(a.bucket_numel))
            except OSError as e:
                derived = " (the port after the DHT's)" if port and not a.transport_port else ""
                error = (f"could not listen for round bytes on {host}:{port}{derived} ({e.strerror or e}); free the "
                         f"port or pick another with --averaging.transport_port")
        port, advertise, error = rt.bcast((transport.port if transport is not None else 0, advertise, error))
        if error:
            raise PeerNetworkError(error)
        if transport is not None and transport.reachable:
            serve_dial_back(transport)
        if not rt.is_main:
            try:
                transport = Transport(identity_of(self.dht), run_key, host=host, port=port, advertise=advertise,
                                      encrypt=a.encrypt, reachable=not a.client_mode, slot=rt.rank,
                                      punch=a.hole_punch, max_message=message_limit(a.bucket_numel))
            except OSError as e:
                error = f"rank {rt.rank} could not take its share of the transport's port {port}: {e.strerror or e}"
        rt.raise_if_any(error, PeerNetworkError)
        return transport

    def _dht_client(self) -> bool:
        """Whether this rank's DHT serves nobody: every rank but the island's first, whose bytes and requests
        come over the transport (over hivemind's daemon, ``--averaging.transport p2p``, every rank serves)."""
        return self.rt.rank > 0 and self.a.transport != "p2p"

    def _start_dht(self, run_key: str, remembered: list[str], alone_ok: bool = False, port: int = 0) -> Any:
        """One DHT per rank (collective over the world): rank 0 joins the run's initial peers and the
        islands it ``remembered`` from before a restart (if none answers: alone, when it has no initial
        peers or ``alone_ok``), the other ranks bootstrap from it (and from the initial peers).  An island's first
        rank listens on the configured port (+ 2 per local rank when several islands share a server:
        :data:`PORTS_PER_RANK`; port 0 stays 0, unless ``port`` says which one it listened on before); the
        island's other ranks run client nodes on loopback (see :meth:`_dht_client`).  Rank ``r`` keeps its
        identity in ``<identity_path>.rank<r>``."""
        a, rt = self.a, self.rt
        local_rank = _local_rank(rt)
        key = a.identity_path or str(self.run_dir / IDENTITY)
        identity = f"{key}.rank{local_rank}" if local_rank else key

        def network(initial: list[str]) -> NetworkSettings:
            if self._dht_client():  # reached by nobody: no port of the server to open for it
                return dataclasses.replace(a, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                           announce_maddrs=[], identity_path=identity, run_key=run_key,
                                           client_mode=True)
            shift = PORTS_PER_RANK * local_rank
            return dataclasses.replace(
                a, initial_peers=initial, host_maddrs=[_shift_port(m, shift, port) for m in a.host_maddrs],
                announce_maddrs=[_shift_port(m, shift) for m in a.announce_maddrs], identity_path=identity,
                run_key=run_key)

        open_keys = (key_check_key(a.run_id),)

        dht, error, boot, kind = None, "", [], PeerNetworkError
        if rt.global_rank == 0:
            initial = list(a.initial_peers) + [p for p in remembered if p not in a.initial_peers]
            try:
                try:
                    dht = start_dht(network(initial), open_keys)
                except PortTakenError:
                    raise
                except PeerNetworkError:
                    if not remembered or (a.initial_peers and not alone_ok):
                        raise
                    # the first island of the run restarting: nobody it knew answers, so it starts the run anew
                    log.warning("none of the %d peer address(es) this island knew answered; starting a new peer "
                                "network (other islands must join it; this island keeps trying to reach them)",
                                len(remembered))
                    dht = start_dht(network([]), open_keys)
                if remembered:
                    log.info("bootstrapped through --initial-peers and %d remembered peer address(es)",
                             len(remembered))
                dht = self._behind_nat_if_unreached(dht, initial, network, open_keys, run_key)
                boot = visible_maddrs(dht)
            except PeerNetworkError as e:
                error, kind = str(e), type(e)
        boot, error, kind = rt.bcast((boot, error, kind), world=True)
        if error:
            raise kind(error)
        if rt.global_rank != 0:
            initial = list(boot) + [p for p in a.initial_peers if p not in boot]
            try:
                dht = start_dht(network(initial), open_keys)
                if rt.is_main:
                    dht = self._behind_nat_if_unreached(dht, initial, network, open_keys, run_key)
            except PeerNetworkError as e:
                error = f"rank {rt.global_rank}: {e}"
        try:
            rt.raise_if_any(error, PeerNetworkError, world=True)
        except PeerNetworkError:
            if dht is not None:
                dht.shutdown()
            raise
        if rt.bcast(self.behind_nat) and not self.a.client_mode:
            self.a = dataclasses.replace(self.a, client_mode=True)
        return dht

    def _behind_nat_if_unreached(self, dht: Any, initial: list[str], network: Callable[..., NetworkSettings],
                                 open_keys: tuple[str, ...], run_key: str) -> Any:
        """On an island's rank 0 that joins a run (``initial`` peers) and has not declared itself behind NAT:
        ask the run's reachable islands to connect back (:mod:`peers.wire.dial_back`).  When none can, restart
        the DHT node as a client and take part as ``--averaging.client_mode true`` would (:attr:`behind_nat`);
        the DHT node to use from now on.  One that declared itself behind NAT (and announces no address) asks
        only the address they see it at, its NAT's, which its transport announces for hole punching."""
        a = self.a
        if not a.dial_back or not initial or a.transport != "direct":
            return dht
        if a.client_mode:
            if a.hole_punch and not _ip_of(a.announce_maddrs):
                self.seen_ip = self._dial_back(dht, run_key, dial=False).seen
                log.info("behind NAT: the run's reachable islands see this one at %s", self.seen_ip or "(no answer)")
            return dht
        found = self._dial_back(dht, run_key)
        if found.reached is None:
            log.info("could not learn whether other islands can reach this one (%s); taking part as reachable",
                     "no reachable island registered to ask" if not found.asked else
                     f"none of {len(found.asked)} island(s) asked answered")
            return dht
        if found.reached:
            log.info("reachable: an island of the run connected back to %s", ", ".join(found.addresses))
            return dht
        log.warning("no island of the run could connect to %s (a NAT or a firewall drops connections to this "
                    "server): taking part behind NAT, as with --averaging.client_mode true; to be reachable, "
                    "open or forward the ports and announce the public address with --averaging.announce_maddrs",
                    ", ".join(found.failed))
        self.behind_nat = True
        self.seen_ip = found.seen
        port = tcp_port(dht)
        dht.shutdown()
        settings = network(initial)
        return start_dht(dataclasses.replace(settings, client_mode=True, host_maddrs=[
            _shift_port(m, 0, port) for m in settings.host_maddrs]), open_keys)

    def _dial_back(self, dht: Any, run_key: str, dial: bool = True) -> Reachability:
        """Wait (up to the startup timeout) for reachable islands in the run's registry, then ask up to two of
        them to connect back to this island's transport port and DHT port (``dial`` False: only where they see
        the question come from)."""
        a = self.a
        responders = reachable_islands(dht, a.run_id, a.startup_timeout)
        if not responders:
            return Reachability(None, [])
        advertise = _advertised_ip(a, dht)
        announced = next((e for e in map(tcp_endpoint, a.announce_maddrs) if e), None)
        dht_address = f"{announced[0]}:{announced[1]}" if announced else f"{advertise}:{tcp_port(dht)}"
        return ask_dial_back(identity_of(dht), run_key, a.encrypt, responders, _listen_ip(a),
                             transport_port(a, _local_rank(self.rt)), advertise, [dht_address], dial=dial)


class AloneWatch:
    """Notices when an island is cut off from islands it knew live, and says when to restart its peer node through
    their addresses: after ``rejoin_after`` seconds, then at doubling intervals (up to ten times that, with jitter so
    that two lonely islands do not retry in step).  Cut off means alone in the run (it restarted while none of them
    answered, or the network split), or apart from islands of the committed roster whose records stopped
    refreshing here, at least half of it (the side of a partition without a majority): a partition healed, but each
    side's DHT lost the other side's nodes from its routing tables and, having company of its own, would never look
    for them again.  Only addresses that answer are used (a dead
    island's does not; while the partition lasts, the other side's do not either)."""

    def __init__(self, rejoin_after: float):
        self.first = rejoin_after
        self.since: float | None = None
        self.wait = rejoin_after

    def due(self, membership: Membership | None, known: list[str], committed: Collection[str] = ()) -> list[str]:
        """On rank 0: the addresses of ``known`` to reach now ([] if the island is not cut off or it is not yet
        time); ``committed``: the run's committed roster as this island holds it."""
        others = membership.others() if membership is not None else []
        heard = {m.island for m in others if not membership.silent(m)}
        apart = {i for i in committed if i != getattr(membership, "island", "") and i not in heard}
        # only cut off from at least half of the roster (the side without a majority): a restart leaves the
        # island's address refusing connections for a moment, and the others then count it out of their quorum
        if 2 * len(apart) < len(committed):
            apart = set()
        wanted = known if not others else [k for k in known if k.rsplit("/p2p/", 1)[-1] in apart]
        if membership is None or not wanted:
            self.since, self.wait = None, self.first
            return []
        alone = "alone in the run" if not others else f"apart from {len(apart)} island(s) of the committed roster"
        now = time.monotonic()
        if self.since is None:
            self.since = now
            log.warning("%s although %d peer address(es) of them were live before; trying to reach them again in "
                        "%.0f s", alone, len(wanted), self.wait)
        if now - self.since < self.wait:
            return []
        # alone, back off (a restart costs seconds); apart, look again as often (a look costs one connect
        # timeout, the addresses tried at once): the run stays split until the look succeeds
        self.since, self.wait = now, (self.first if others else min(2 * self.wait, 10 * self.first)) * \
            random.uniform(0.8, 1.2)
        with ThreadPoolExecutor(max_workers=min(16, len(wanted))) as pool:
            answering = [k for k, ok in zip(wanted, pool.map(listens, wanted)) if ok]
        if not answering:
            log.warning("still %s: none of the %d known peer address(es) answers; trying again in %.0f s", alone,
                        len(wanted), self.wait)
            return []
        log.warning("still %s: restarting the peer node through %d known peer address(es) that answer", alone,
                    len(answering))
        return answering


def announce_join(name: str, dht: Any, a: PeerSettings, run_key: RunKey | None, reachable: bool = True,
                  round_port: int = 0) -> None:
    """Print the line other islands join with, naming the TCP ports they connect to (the DHT's, as announced,
    and the transport's, ``round_port``: what a firewall in front of this server must let in), and in a private
    run the file that holds the run key (never the key: the line lands in logs and terminals); behind NAT, that
    they join through a reachable island instead.  Write the addresses to ``maddr_file`` (atomically) if set."""
    maddrs = visible_maddrs(dht)
    key = "" if run_key is None else (
        f" --averaging.run_key_file FILE, FILE a copy of {run_key.file.resolve()} from this server (the run key: "
        f"copy it as you would an ssh key, and keep it mode 600)")
    if reachable:
        dht_ports = sorted({e[1] for e in map(tcp_endpoint, maddrs) if e})
        named = [f"{p} (DHT)" for p in dht_ports] + ([f"{round_port} (transport)"] if round_port else [])
        print(f"[{name}] other islands connect to TCP port{'s' if len(named) > 1 else ''} {' and '.join(named)} "
              f"here and join with --initial-peers {','.join(maddrs)}{key}", flush=True)
    else:
        print(f"[{name}] this island is behind NAT and accepts no connection: other islands join the run through a "
              f"reachable island's --initial-peers{key}", flush=True)
    if a.maddr_file:
        tmp = Path(a.maddr_file + ".tmp")
        tmp.write_text("\n".join(maddrs) + "\n")
        os.replace(tmp, a.maddr_file)


def remember(run_dir: Path, name: str, text: str) -> None:
    """Write ``text`` to ``name`` in the run dir atomically."""
    path = run_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def remembered(run_dir: Path, name: str) -> str:
    """What :func:`remember` wrote to ``name`` in the run dir ('' if nothing)."""
    path = run_dir / name
    return path.read_text() if path.is_file() else ""


def _ip_of(maddrs: list[str]) -> str:
    """The IP address of the first ``/ip4/`` or ``/ip6/`` multiaddr of ``maddrs`` ('' if none)."""
    for m in maddrs:
        found = re.match(r"/ip[46]/([^/]+)", m)
        if found:
            return found[1]
    return ""


def _listen_ip(a: NetworkSettings) -> str:
    """The IP address this island's transport listens on: the DHT's (``--averaging.host_maddrs``), else loopback."""
    return _ip_of(a.host_maddrs) or "127.0.0.1"


def _advertised_ip(a: NetworkSettings, dht: Any) -> str:
    """The IP address this island's transport announces: the announced one, else the one it listens on, else
    (listening on every interface) the DHT's first visible address that is not loopback."""
    host = _listen_ip(a)
    return _ip_of(a.announce_maddrs) or (host if host not in ("0.0.0.0", "::") else _visible_ip(dht))


def _visible_ip(dht: Any) -> str:
    """An address other islands can reach this machine at: the DHT's first visible one that is not loopback."""
    ips = [_ip_of([m]) for m in visible_maddrs(dht)]
    return next((ip for ip in ips if ip and not ip.startswith("127.")), "127.0.0.1")


def _local_rank(rt: IslandRanks) -> int:
    return int(os.environ.get("LOCAL_RANK", rt.global_rank))


def _shift_port(maddr: str, by: int, instead_of_0: int = 0) -> str:
    """``maddr`` with its TCP/UDP port moved up by ``by`` (port 0, "any free port", stays 0, or becomes
    ``instead_of_0`` for TCP)."""
    def port(m: re.Match) -> str:
        p = int(m[2])
        return f"/{m[1]}/{p + by if p else (instead_of_0 if m[1] == 'tcp' else 0)}"
    return re.sub(r"/(tcp|udp)/(\d+)", port, maddr)

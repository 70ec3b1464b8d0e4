"""Whether other servers can open connections to this island: asked of a reachable island of the run, which
dials back.

An island behind a NAT or a firewall that drops incoming connections must take part through lanes (see
:mod:`peers.wire.nat`); one that does not know it would announce an address nobody can reach, and its
rounds would fail.  Before it announces anything, a joining island listens where its transport will listen,
asks one or more reachable islands (over their transports: only holders of the run key may ask) to connect
to the address it would announce and to its DHT's port, and reads their answers.  A reached listener writes
a fresh nonce that the dialer checks against the one the question named, so that a port answered by some other
machine (a NAT's own service, a stale forward) does not count.  The asker's own transport for the question cannot
be reached either, so the answer comes back over its lane.

A dialer is no tool for anyone else's ends: it connects only to the address the question came from (an address
that resolves to another is answered "not reached" without a connection, and a question passed on by a relay is
not answered), answers only whether it reached each address (never a byte it read there), and dials for
:data:`DIALING` questions at once.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

from peers.identity import Identity
from peers.wire.transport import Transport, TransportError, parse_endpoint

log = logging.getLogger(__name__)

REQUEST = "dial-back?"
"""Key prefix of a request to connect to the asker's addresses."""
REPLY = "dial-back!"
"""Key prefix of the answer."""
CONNECT_TIMEOUT = 3.0
"""Seconds the dialer waits for each connection (a NAT drops the SYN: nothing ever answers)."""
MAX_ADDRESSES = 4
"""Addresses one request may name: a dial-back is a connection the asker asked for, and no more."""
NONCE_BYTES = 16
DIALING = 4
"""Questions a reachable rank dials for at once; more are dropped (their askers learn nothing, not "unreachable")."""


@dataclass
class Reachability:
    """What the islands asked found (``reached`` None: nobody answered, so nothing is known)."""

    reached: bool | None
    addresses: list[str]
    """The addresses the islands were asked to connect to."""
    seen: str = ""
    """The IP address the islands that answered saw the question come from: behind a NAT, the NAT's public
    one, which this island announces for hole punching (:mod:`peers.wire.transport`)."""
    failed: list[str] = field(default_factory=list)
    """Those no island could connect to."""
    asked: list[str] = field(default_factory=list)
    """The transport endpoints asked."""
    answered: int = 0


def serve_dial_back(transport: Transport) -> None:
    """Let the run's islands ask this reachable rank whether it can connect to them (see the module's docstring)."""
    dialing = threading.BoundedSemaphore(DIALING)

    def on_request(key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        try:
            request = json.loads(bytes(payload))
            addresses = [str(a) for a in request["addresses"]][:MAX_ADDRESSES]
            greeted = {str(a) for a in request.get("greeted", addresses)}
            nonce = bytes.fromhex(str(request.get("nonce", "")))
            reply, to = str(request["reply"]), str(request["reply_to"])
        except (ValueError, KeyError, TypeError):
            log.warning("refused a malformed dial-back request from %s", sender)
            return True
        if "_via" in extra:
            log.warning("refused a dial-back request from %s passed on by %s: only one that comes straight from "
                        "its asker says where to dial", sender, extra["_via"])
            return True
        if not dialing.acquire(blocking=False):
            log.info("dropped a dial-back request from %s: %d others are being dialed for", sender, DIALING)
            return True

        def dial() -> None:
            try:
                _dial(transport, addresses, greeted, nonce, reply, to, str(extra.get("_seen", "")))
            finally:
                dialing.release()

        threading.Thread(target=dial, name="dial-back", daemon=True).start()
        return True

    transport.handlers[REQUEST] = on_request


def _ip(host: str) -> str:
    """``host`` as one spelling of its IP address (an IPv4 address mapped into IPv6 as IPv4); unchanged when it
    is not an IP address."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return host
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _at(address: str, seen: str) -> tuple[str, int] | None:
    """Where to connect for ``address`` (``host:port``, the host a name or an IP address) when it is the address
    ``seen`` (where a question came from); None when it is another, or names nothing."""
    try:
        host, port = parse_endpoint(address)
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError, UnicodeError):
        return None
    return next(((sockaddr[0], port) for *_, sockaddr in found if seen and _ip(sockaddr[0]) == _ip(seen)), None)


def _dial(transport: Transport, addresses: list[str], greeted: set[str], nonce: bytes, reply: str, to: str,
          seen: str) -> None:
    """Connect to each address that is at ``seen`` (the address the question came from), check that those
    ``greeted`` write ``nonce`` (the others, such as a DHT's port, speak only when spoken to: connecting is all),
    and send which were reached to the asker, with the address ``seen``."""
    reached = {}
    for address in addresses:
        at = _at(address, seen)
        if at is None:
            log.info("did not dial %s back: the question came from %s", address, seen or "nowhere known")
            reached[address] = False
            continue
        try:
            with socket.create_connection(at, timeout=CONNECT_TIMEOUT) as s:
                s.settimeout(CONNECT_TIMEOUT)
                got = b""
                try:
                    while address in greeted and len(got) < NONCE_BYTES:
                        chunk = s.recv(NONCE_BYTES - len(got))
                        if not chunk:
                            break
                        got += chunk
                except OSError:
                    pass  # connected, yet nothing came: a port that is open, but not the asker's listener
                reached[address] = address not in greeted or (len(nonce) == NONCE_BYTES and got == nonce)
        except OSError:
            reached[address] = False
    try:
        transport.send(to, reply, json.dumps({"reached": reached, "seen": seen}).encode(),
                       time.monotonic() + 2 * CONNECT_TIMEOUT)
    except TransportError as e:
        log.info("could not answer a dial-back request: %s", e)


def _answer(payload: bytes | bytearray) -> dict | None:
    """A dial-back answer as sent ({} if it is not an object; None if it is not JSON)."""
    try:
        answer = json.loads(bytes(payload))
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else {}


class _Listener:
    """Listens at ``host:port`` and writes ``nonce`` to whoever connects, until closed."""

    def __init__(self, host: str, port: int, nonce: bytes):
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port, self.nonce = self.sock.getsockname()[1], nonce
        threading.Thread(target=self._accept, name="dial-back-listener", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(CONNECT_TIMEOUT)
                    conn.sendall(self.nonce)
                    conn.recv(1)  # the dialer closes first: the port is free to listen on again at once
                except OSError:
                    pass

    def close(self) -> None:
        """Stop listening, so that the transport can listen on the port next."""
        try:  # a close alone leaves the socket listening while the accept thread still blocks in accept()
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def ask_dial_back(identity: Identity, run_key: str, encrypt: bool, responders: list[str], listen_host: str,
                  listen_port: int, advertise: str, also: list[str], timeout: float = 0.0,
                  dial: bool = True) -> Reachability:
    """Ask the reachable islands at ``responders`` (transport endpoints) to connect to this island: to
    ``advertise:PORT``, where a listener on ``listen_host:listen_port`` (0: a free port, standing for one) stands
    in for the transport, and to each address of ``also`` (the DHT's: any connection counts).  Reachable when
    an island reached them all; not reachable when islands answered and none did.  ``timeout``: seconds to
    wait for the answers (0: long enough for every connection to time out).  ``dial`` False: ask only where the
    question came from (:attr:`Reachability.seen`, the address a NAT gives this island's connections), connecting
    to nothing.  ``identity``: the island's (its rank 0's DHT's), which its question is signed with."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    listener = None
    if dial:
        try:
            listener = _Listener(listen_host, listen_port, nonce)
        except OSError as e:  # the transport, listening there next, says what to do about it
            log.info("could not listen on %s:%d to be dialed back: %s", listen_host, listen_port, e)
            return Reachability(None, [])
    mine = f"{advertise}:{listener.port}" if listener else ""
    addresses = [mine] + [a for a in also if a != mine][:MAX_ADDRESSES - 1] if listener else []
    asker = Transport(identity, run_key, host=listen_host, advertise=advertise, encrypt=encrypt,
                      reachable=False)
    reply = f"{REPLY}{os.getpid()}.{secrets.token_hex(4)}"
    out = Reachability(None, addresses, asked=list(responders))
    try:
        request = json.dumps({"addresses": addresses, "greeted": [mine], "nonce": nonce.hex(), "reply": reply,
                              "reply_to": asker.endpoint}).encode()
        deadline = time.monotonic() + (timeout or (len(addresses) + 1) * CONNECT_TIMEOUT + 2.0)
        asked = 0
        for endpoint in responders:
            try:
                asker.send(endpoint, f"{REQUEST}{secrets.token_hex(4)}", request, deadline)
                asked += 1
            except TransportError as e:
                log.info("could not ask %s to dial back: %s", endpoint, e)
        answers = asker.box.wait_for(reply, lambda got: len(got) >= asked, deadline) if asked else {}
    finally:
        asker.close()
        if listener:
            listener.close()
    out.answered = len(answers)
    parsed = [a for a in map(_answer, answers.values()) if a is not None]
    out.seen = next((s for a in parsed if isinstance(s := a.get("seen"), str) and s), "")
    if not answers or not dial:
        return out
    reports = [r if isinstance(r := a.get("reached"), dict) else {} for a in parsed]

    def reached(address: str, report: dict) -> bool:
        return report.get(address) is True

    out.failed = [a for a in addresses if not any(reached(a, r) for r in reports)]
    out.reached = any(all(reached(a, r) for a in addresses) for r in reports)
    return out


"""Where an island rank listens, what it announces and whom it joins: the settings of its peer node.

Plain data without hivemind, so that the trainer's config section ``averaging`` can *be* these settings
(:class:`diloco.config.AveragingConfig` extends :class:`NetworkSettings`) rather than copy them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NetworkSettings:
    """Where an island listens, what it announces and whom it joins."""

    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of running islands or bootstrap nodes (ending in /p2p/PEER_ID); empty starts a new run."""
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    """Multiaddrs this island listens on; use /ip4/0.0.0.0/tcp/PORT to accept peers from other servers."""
    announce_maddrs: list[str] = field(default_factory=list)
    """Multiaddrs to advertise to peers (your public IP and forwarded port), if not the listening ones."""
    identity_path: str = ""
    """File holding this island's private key, so its peer id stays the same across restarts."""
    client_mode: bool = False
    """Accept no incoming connections (an island behind a firewall); it can still join groups."""
    startup_timeout: float = 20.0
    """Seconds to connect to initial peers before giving up with an error."""
    run_key: str = ""
    """Shared secret of the run: only islands holding it can join, average or download state. Empty on
    the first island: a key is generated and printed; islands joining a private run must pass it."""

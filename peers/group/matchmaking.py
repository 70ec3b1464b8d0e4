"""The hivemind averager subclass behind :class:`peers.group.averager.VerifiedAverager`.

Its class name stays ``_PseudoGradientAverager``: hivemind names a group's protocol handlers after the
averager class, so islands running another name could not meet.
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator

import hivemind
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture

from peers.discovery.membership import MemberCheck

log = logging.getLogger(__name__)



class _PseudoGradientAverager(hivemind.DecentralizedAverager):
    """hivemind averager that forms an island's groups and serves no state (islands download θ_global over their
    transports, :mod:`peers.wire.state_share`).  A step ends once its group formed, with every member's metadata:
    it averages nothing (the islands' pseudo-gradients travel over their own channels).

    With ``members`` set (a private run) it serves only peers registered in the run's member registry:
    an outsider can neither join a group, nor send parts, nor download anything.  Every island of a
    run must use this class (hivemind keys groups by the class name and prefix).
    """

    def __init__(self, *args: Any, members: MemberCheck | None = None, **kwargs: Any):
        self._members = members
        super().__init__(*args, **kwargs)

    def get_current_state(self):  # runs in this (host) process, in hivemind's fetcher thread
        return {}, [], None

    async def _shutdown(self, timeout: float | None) -> None:  # runs in the averager process
        try:
            await super()._shutdown(timeout)
        except OSError as e:  # Ctrl-C reached its p2p daemon too: nothing is left to unregister from
            log.debug("averager shutdown: p2p daemon already gone (%r)", e)
        finally:  # hivemind leaves its replica of the daemon open, and the replica's socket file in /tmp
            await self._p2p.shutdown()

    async def _is_member(self, remote_id: PeerID) -> bool:
        """Runs in the averager process: is the calling peer registered in the run?"""
        return self._members is None or await self._members.allows(str(remote_id))

    def set_target_group_size(self, size: int | None, timeout: float = 30.0) -> None:
        """Assemble the next groups as soon as ``size`` peers joined (None: whoever joins within
        min_matchmaking_time).  hivemind reads its matchmaker's ``target_group_size`` each time a peer
        joins; this sets it in the averager's process through the same command pipe hivemind's own
        ``set_group_bits`` uses."""
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result(timeout)

    async def _set_target_group_size(self, size: int | None, future: MPFuture) -> None:
        try:
            self._matchmaking.target_group_size = size
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)

    async def _aggregate_with_group(self, group_info: Any, *args: Any, **kwargs: Any) -> Any:  # averager process
        """The group's metadata by member, as hivemind's own aggregation returns it, without its all-reduce: the
        leader's message that formed the group carried them, and an all-reduce of one number cost every round
        about one more round trip (2.65 s rounds against 2.38 s at 250 ms, docs/averaging.md) to learn nothing the
        exchange and the vote do not check.  It was also when every member learned at once of one that died after
        the group formed: :meth:`peers.wire.encoded.DirectChannel._tell_gone` now tells them."""
        self._running_groups[group_info.group_id].set_result(None)  # no all-reduce will run in this group
        try:
            gathered = [self.serializer.loads(self.serializer.loads(g)[2]) for g in group_info.gathered]
        except Exception as e:  # what hivemind's aggregation raises for a member's unreadable metadata
            raise MatchmakingException(f"Unable to read the group's metadata: {e}") from e
        return dict(zip(group_info.peer_ids, gathered))

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._is_member(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._is_member(context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._is_member(context.remote_id):
            return
        async for message in super().rpc_download_state(request, context):
            yield message


def cancel_step(control: Any, wait: float = 5.0) -> None:
    """Stop a hivemind step that is still looking for a group, and wait (up to ``wait`` s) for it to end.

    ``StepControl.cancel()`` sends the averager's process its cancel notice before it marks the step
    cancelled; a process that reads the notice first sees a step that is not cancelled and goes on
    matching, and may then join a later round's group with this round's data (seen as "islands were at
    different rounds" by that group).  Marking the future cancelled first closes that window."""
    MPFuture.cancel(control)
    control.cancel()
    deadline = time.monotonic() + wait
    while control.stage != AveragingStage.FINISHED and time.monotonic() < deadline:
        time.sleep(0.01)

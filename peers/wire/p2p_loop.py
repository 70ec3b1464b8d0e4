"""Talking to hivemind's p2p daemon from the host process: one asyncio loop, one P2P replica per DHT.

hivemind's ``DHT.replicate_p2p`` caches one replica per DHT, bound to the loop that created it, so
every channel of this process (the vote's verdicts, the encoded pseudo-gradients) runs its handlers
and calls on one loop in a background thread, and the last channel of a DHT stops its replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import hivemind
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hivemind.p2p import P2P

log = logging.getLogger(__name__)

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _submit(coro: Coroutine) -> concurrent.futures.Future:
    """Run ``coro`` on this process's p2p loop thread (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="diloco-p2p", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _loop)


def spawn(coro: Coroutine, tasks: set[asyncio.Future]) -> asyncio.Future:
    """On the p2p loop: run ``coro`` without waiting for it, held in ``tasks`` until it ends (asyncio keeps
    only weak references to tasks, so one nobody holds may vanish mid-flight)."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


_replicas: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""DHT -> [its daemon's P2P replica in this process, channels using it]; touched on the loop thread only."""


async def acquire_p2p(dht: hivemind.DHT) -> P2P:
    """This process's replica of ``dht``'s daemon (one more channel uses it)."""
    entry = _replicas.get(dht)
    if entry is None:
        p2p = await dht.replicate_p2p()
        if not p2p.is_alive:  # hivemind keeps handing out the replica we shut down earlier
            p2p = await P2P.replicate(p2p.daemon_listen_maddr)
        entry = _replicas[dht] = [p2p, 0]
    entry[1] += 1
    return entry[0]


async def release_p2p(dht: hivemind.DHT) -> None:
    """The last channel on ``dht`` stops its replica: its tasks would otherwise outlive the loop at exit."""
    entry = _replicas.get(dht)
    if entry is not None:
        entry[1] -= 1
        if entry[1] <= 0:
            del _replicas[dht]
            await entry[0].shutdown()


_TYPES = {"string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
          "double": descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
          "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
          "uint64": descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
          "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES}


def message_class(name: str, fields: Sequence[tuple[str, ...]]) -> type:
    """A protobuf message class ``diloco.<name>`` with ``fields`` = (name, type[, "repeated"]), numbered in
    order, built in a private descriptor pool (nothing to clash with in the default one)."""
    label = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name=f"diloco_{name.lower()}.proto", package="diloco",
                                               syntax="proto3")
    msg = proto.message_type.add(name=name)
    for number, (field, kind, *repeated) in enumerate(fields, start=1):
        msg.field.add(name=field, number=number, type=_TYPES[kind],
                      label=label.LABEL_REPEATED if repeated else label.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"diloco.{name}"))


class Handler:
    """A protocol handler of ours on a DHT's p2p daemon (``name``, taking ``message_type`` messages, a
    stream of them with ``stream_input``), served on this process's loop until :meth:`close`."""

    def __init__(self, dht: hivemind.DHT, name: str, handler: Callable[..., Awaitable[Any]], message_type: type,
                 stream_input: bool = False):
        self.dht, self.name, self.stream_input = dht, name, stream_input
        self.p2p: P2P | None = None
        _submit(self._register(handler, message_type)).result(30.0)

    async def _register(self, handler: Callable[..., Awaitable[Any]], message_type: type) -> None:
        self.p2p = await acquire_p2p(self.dht)
        await self.p2p.add_protobuf_handler(self.name, handler, message_type, stream_input=self.stream_input)

    def close(self) -> None:
        """Stop serving ``name`` (the DHT and its daemon are the caller's)."""
        if self.p2p is None:
            return
        try:
            _submit(self._unregister()).result(10.0)
        except Exception as e:  # the daemon may be gone already
            log.debug("could not remove the %s handler: %s", self.name, e)
        self.p2p = None

    async def _unregister(self) -> None:
        try:
            await asyncio.wait_for(self.p2p.remove_protobuf_handler(self.name, stream_input=self.stream_input), 5.0)
        finally:
            await release_p2p(self.dht)

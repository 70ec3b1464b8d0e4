"""A donor rank serves θ_global and the outer momentum wherever they are, and a joiner hears at once when a donor
cannot read them (real transports on loopback, a one-process island's exchange).

θ_global on a GPU (``--diloco.master_device cuda``) is played by torch's ``lazy`` device: real values computed on
the host, but not the CPU device, so what a GPU tensor refuses (``.numpy()``, a ``cat`` with host tensors) it
refuses too."""

from __future__ import annotations

import threading

import pytest
import torch

from peers.island.exchange import BucketExchange
from peers.island.layout import CanonicalLayout
from peers.wire.state_share import StateServer, download
from tests.collective_audit import lazy_device
from tests.test_transport import identity

PARAMS = [("emb", (6, 4)), ("w", (4, 5)), ("norm", (4,))]
BUCKET = 20


@pytest.fixture
def donor_and_joiner():
    from peers.wire.transport import Transport

    made = [Transport(identity("donor")), Transport(identity("joiner"))]
    yield made
    for t in made:
        t.close()


def _serve(donor, provide) -> tuple[CanonicalLayout, StateServer]:
    layout = CanonicalLayout.build(PARAMS, BUCKET)
    shapes = {n: s for n, s in PARAMS}
    exchange = BucketExchange(layout, shapes, {n: (0, 0, s[0]) for n, s in PARAMS}, None)
    return layout, StateServer(donor, exchange, provide, threading.Lock())


@pytest.mark.parametrize("momentum", ["zeros on the host", "beside theta"])
def test_a_donor_serves_theta_held_off_the_host(donor_and_joiner, momentum):
    donor, joiner = donor_and_joiner
    g = torch.Generator().manual_seed(0)
    host = {n: torch.randn(s, generator=g) for n, s in PARAMS}
    device = lazy_device()
    theta = {n: t.to(device) for n, t in host.items()}
    # before the first outer step an optimizer without momentum hands out zeros on the host
    moments = {n: torch.zeros(s) for n, s in PARAMS} if momentum == "zeros on the host" else \
        {n: (2 * t).to(device) for n, t in host.items()}
    layout, _ = _serve(donor, lambda: ({"outer_step": 3}, theta, moments))
    got, why = download(joiner, [donor.endpoint], {b.index: b.numel for b in layout.buckets}, 20.0, "t")
    assert why == "" and sorted(got) == [b.index for b in layout.buckets]
    flat = torch.cat([host[n].reshape(-1) for n, _ in PARAMS])
    for b in layout.buckets:
        assert got[b.index].meta == {"outer_step": 3}
        assert torch.equal(got[b.index].theta, flat[b.start:b.end])
        expected = torch.zeros(b.numel) if momentum == "zeros on the host" else 2 * flat[b.start:b.end]
        assert torch.equal(got[b.index].momentum, expected)


def test_a_donor_that_cannot_read_its_state_tells_the_joiner_and_serves_on(donor_and_joiner):
    donor, joiner = donor_and_joiner
    calls = []

    def first_fails():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the state is somewhere it cannot be read from")
        return {"outer_step": 1}, {n: torch.ones(s) for n, s in PARAMS}, {n: torch.zeros(s) for n, s in PARAMS}

    layout, _ = _serve(donor, first_fails)
    bucket = {0: layout.buckets[0].numel}
    got, why = download(joiner, [donor.endpoint], bucket, 15.0, "t")
    assert got == {}
    assert why.startswith("a donor rank could not read its state: RuntimeError: the state is somewhere"), why
    got, why = download(joiner, [donor.endpoint], bucket, 15.0, "u")
    assert why == "" and torch.equal(got[0].theta, torch.ones(bucket[0]))

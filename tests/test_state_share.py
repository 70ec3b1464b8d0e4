"""A donor rank serves θ_global and the outer momentum wherever they are, a joiner hears at once when a donor
cannot read them, and witness islands confirm a download by keyed prints only when it is the θ_global they hold
(real transports on loopback, one-process islands' exchanges and the pieces of a two-rank island).

θ_global on a GPU (``--diloco.master_device cuda``) is played by torch's ``lazy`` device: real values computed on
the host, but not the CPU device, so what a GPU tensor refuses (``.numpy()``, a ``cat`` with host tensors) it
refuses too."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from peers import CHUNKS_PER_BUCKET, fingerprint, fingerprints_agree
from peers.island.exchange import BucketExchange, by_bucket
from peers.island.layout import CanonicalLayout
from peers.wire import state_share
from peers.wire.state_share import StateServer, download, keyed_print, keyed_weights, witness
from tests.collective_audit import lazy_device
from tests.test_transport import identity, transports  # noqa: F401 (a fixture)

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


def test_keyed_prints_depend_on_the_seed_and_bucket_and_add_up_over_any_cut_of_a_bucket():
    at = torch.arange(1000)
    w = keyed_weights(at, 7, 0)
    assert torch.equal(w[300:400], keyed_weights(at[300:400], 7, 0))  # a rank holding only these elements
    assert not torch.equal(w, keyed_weights(at, 8, 0)) and not torch.equal(w, keyed_weights(at, 7, 1))
    assert bool(((w >= -1) & (w < 1)).all()) and abs(float(w.mean())) < 0.1 and 0.5 < float(w.std()) < 0.65
    bucket = torch.randn(1000)
    whole, magnitude = keyed_print(bucket.view(1, 1000), 0, 1000, 7, 0)
    assert whole == pytest.approx(float((bucket.double() * w).sum()), rel=1e-12)
    assert magnitude == pytest.approx(float((bucket.double() * w).abs().sum()), rel=1e-12)
    # columns 0-9 and 10-39 of a 25 x 40 matrix: strided pieces, and blocks smaller than a row
    left = keyed_print(bucket.view(25, 40)[:, :10], 0, 40, 7, 0)[0]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(state_share, "PRINT_BLOCK", 16)
        right = keyed_print(bucket.view(25, 40)[:, 10:], 10, 40, 7, 0)[0]
    assert left + right == pytest.approx(whole, rel=1e-12)
    assert keyed_print(bucket.view(1, 1000), 0, 1000, 8, 0)[0] != whole


def _island(transports, name: str, theta: dict[str, torch.Tensor], specs: list[dict], meta: dict) -> list[str]:
    """An island of ``len(specs)`` ranks serving shards of ``theta`` (one spec per parameter and rank): its
    endpoints."""
    layout = CanonicalLayout.build(PARAMS, BUCKET)
    endpoints = []
    for r, spec in enumerate(specs):
        t = transports(f"{name}{r}")
        shards = {n: theta[n].narrow(*spec[n]).contiguous() for n in theta}
        pieces = by_bucket(layout, spec)
        exchange = SimpleNamespace(layout=layout, contribution=lambda b, pieces=pieces: list(pieces.get(b, [])))
        StateServer(t, exchange, lambda shards=shards: (dict(meta), shards, shards), threading.Lock())
        endpoints.append(t.endpoint)
    return endpoints


def test_witnesses_confirm_the_theta_they_hold_and_deny_one_crafted_to_the_registrys_sums(transports):
    """A donor can serve a θ_global with the per-chunk sums the registry vouches for (values permuted inside each
    chunk): the registry's check passes it.  Witness islands, one of one rank and one of two ranks that each hold
    half of every parameter's columns (strided pieces), confirm the honest buckets and deny the permuted ones: the
    seed is picked after the download, so the donor cannot aim at their prints.  A witness rank that does not
    answer leaves its island without a word."""
    g = torch.Generator().manual_seed(1)
    theta = {n: torch.randn(s, generator=g) for n, s in PARAMS}
    layout = CanonicalLayout.build(PARAMS, BUCKET)
    flat = torch.cat([theta[n].reshape(-1) for n, _ in PARAMS])
    honest = {b.index: flat[b.start:b.end].clone() for b in layout.buckets}
    meta = {"outer_step": 4, "committed_rounds": 4}
    whole = {n: (0, 0, s[0]) for n, s in PARAMS}
    split = [{"emb": (1, 0, 2), "w": (1, 0, 2), "norm": (0, 0, 2)}, {"emb": (1, 2, 2), "w": (1, 2, 3), "norm": (0, 2, 2)}]
    islands = [_island(transports, "one", theta, [whole], meta),
               _island(transports, "two", theta, split, meta)]
    joiner = transports("joiner")
    answers = witness(joiner, islands, honest, 20.0, "a")
    assert [(len(metas), same) for metas, same in answers] == [(1, True), (2, True)]
    assert all(m == meta for metas, _ in answers for m in metas)

    crafted = {}
    for b, values in honest.items():
        chunks = torch.tensor_split(values, CHUNKS_PER_BUCKET)
        crafted[b] = torch.cat([c.flip(0) for c in chunks])
        assert not torch.equal(crafted[b], values)
        assert fingerprints_agree(fingerprint([crafted[b]], CHUNKS_PER_BUCKET),
                                  fingerprint([values], CHUNKS_PER_BUCKET), 1e-5)  # what the registry vouches for
    assert [same for _, same in witness(joiner, islands, crafted, 20.0, "b")] == [False, False]
    one = {0: honest[0].clone()}
    one[0][3] += 1e-3  # a small change to one element of one bucket
    assert [same for _, same in witness(joiner, islands, one, 20.0, "c")] == [False, False]

    silent = _island(transports, "mute", theta, split, meta)
    silent.append("127.0.0.1:9")  # a third rank nobody answers for
    assert witness(joiner, [silent, islands[0]], honest, 3.0, "d")[0] is None

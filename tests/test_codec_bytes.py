"""Every codec's exact bytes, pinned: the sha256 of its payloads, of what they decode to and of one round of error
feedback, on fixed tensors.  The digests were computed on the code before the codecs moved into
``outer_optim/compression/``, so a refactor that changes one byte of any wire format fails here.

The tensors are small dyadic rationals (integers times powers of two over 1024), so every float32 sum a codec
takes (a block's mean magnitude, the least-squares fits of a grid) is exact whatever order a CPU's vector units
add in: the digests depend on the formats, not on the machine.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from outer_optim.compression import ErrorFeedback, make_codec

SETTINGS = {  # a name for the digests -> make_codec's arguments
    "none": ("none", {}), "fp16": ("fp16", {}), "int8": ("int8", {}), "int4": ("int4", {}), "int2": ("int2", {}),
    "sign": ("sign", {}),
    "topk-2%-2b": ("topk", {"topk_density": 0.02, "topk_bits": 2}),
    "topk-5%-4b": ("topk", {"topk_density": 0.05, "topk_bits": 4}),
    "topk-50%-2b": ("topk", {"topk_density": 0.5, "topk_bits": 2}),
}
SIZES = (13289, 301)
"""Three whole top-k chunks and a shorter last one, partial blocks of every dense codec, an odd count for int4's
nibbles; and one short tensor, a single block or chunk."""


def dyadic(n: int, seed: int) -> torch.Tensor:
    """``n`` heavy-tailed values a·2^b/1024 (a in [-40, 40], b in [0, 3]) from integer draws, which every machine
    draws alike."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-40, 41, (n,), generator=g).to(torch.float32)
    b = torch.randint(0, 4, (n,), generator=g).to(torch.float32)
    return a * torch.pow(2.0, b) / 1024


def _sha(data: bytes | bytearray | memoryview | torch.Tensor) -> str:
    if isinstance(data, torch.Tensor):
        data = data.contiguous().numpy().tobytes()
    return hashlib.sha256(bytes(data)).hexdigest()[:16]


def digests(key: str) -> list[str]:
    """For each of :data:`SIZES`: the payload's digest, its decoded values', and the payload and new buffer of one
    round of error feedback (decay 0.5, which keeps the values dyadic, carrying another such tensor)."""
    name, kwargs = SETTINGS[key]
    codec = make_codec(name, **kwargs)
    out = []
    for n in SIZES:
        x = dyadic(n, seed=n)
        payload = codec.encode(x)
        out += [_sha(payload), _sha(codec.decode(payload, n))]
        carried, _, buffer = ErrorFeedback(codec, decay=0.5).prepare(x, dyadic(n, seed=n + 1))
        out += [_sha(carried), _sha(buffer)]
    return out


PINNED = {  # sha256 prefixes, in the order of digests()
    'none': ['f79b80ecf4ac5d3a', 'f79b80ecf4ac5d3a', 'c5fe60f3da786084', 'cfb85e73fbafd64a',
             '2b4b2900dfbf7808', '2b4b2900dfbf7808', '371cb4bb075bed06', '3b17f8b83bec3e72'],
    'fp16': ['7551f659bf774fd8', 'f79b80ecf4ac5d3a', '851df3e62d92b31b', 'cfb85e73fbafd64a',
             'c58d560d4cbd457a', '2b4b2900dfbf7808', 'b8e8f5840a4e24f6', '3b17f8b83bec3e72'],
    'int8': ['0e865081f300a1f9', 'df651cc9743b04b0', 'eedef5e67c3c3a59', 'fab6ae58fad3c998',
             'bd282b835d2f89a4', 'c7419925a097c613', 'd489437a385f21a6', 'b2d1672434b9550e'],
    'int4': ['ed51d58a2ecf8f52', 'ffc6e7ca4145754b', '742a9e48ba17390f', 'ce1a8d7e2bdf7e38',
             '3b52b532ab660b4d', '64d0091efef7eb93', '958ff3982fee5024', '6062e3887a3cc1a1'],
    'int2': ['07123d289fc3ec20', '30487bca853eb51c', 'bb86e1764d56aa10', 'b4f0d082c7d214b3',
             '0055f79b40f6f20c', 'd9c4e8cfcb669668', 'c4df18669b93ea21', '1b7aba921761381b'],
    'sign': ['f6443297691364d8', '124d0387c44d0781', 'd411571877a94ba8', '929c37f68d9f0d92',
             'df15e7e79590129b', 'e2317f44b58c2882', '1da3906977785e71', 'e9121998ac860d95'],
    'topk-2%-2b': ['36c076dda45dd25a', 'f5654e14e7d4ebed', '0ad18b821c4b37bf', '34986dca4352c896',
                   'd40de9bcb6db8593', '340991f18c1f586b', '32e081ec2a5a226e', '6f0b4ee623574309'],
    'topk-5%-4b': ['66174e1c7656cbfc', '4527f282b5340e61', '0c1cbcf7ed37f17c', '02d39644b00e91f1',
                   '46e20e74a43b8f10', 'cd9fc1e79fc57bec', '5b726f273caaadb4', '8b426f0316bd4cb3'],
    'topk-50%-2b': ['82912998b04af3ce', '9d7469e1f1ab43ca', '3cda664a3f76186a', '9df85062d420cefc',
                    '89eabbaf10107a5d', '348c16d5f2b1dc18', '47ff6fba042afa77', 'f75b6e6e7d7a88d0'],
}


@pytest.mark.parametrize("key", list(SETTINGS))
def test_every_codec_sends_the_bytes_it_sent_before(key):
    assert digests(key) == PINNED[key]


if __name__ == "__main__":  # prints PINNED for the code as it is
    for k in SETTINGS:
        d = [repr(x) for x in digests(k)]
        print(f"    {k!r}: [{', '.join(d[:4])},\n{' ' * (len(repr(k)) + 7)}{', '.join(d[4:])}],")

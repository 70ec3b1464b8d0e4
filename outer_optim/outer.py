"""The outer optimizer of DiLoCo: an fp32 master copy of θ_global stepped by averaged pseudo-gradients.

Pseudo-gradient Δ = θ_global − θ_local points from where the island ended towards where it started,
so a plain SGD step with lr 1 on Δ lands exactly on θ_local (FedAvg); Nesterov momentum on Δ is
the DiLoCo default.  The optimizer works on named tensors (this rank's local shards under tensor or
pipeline parallelism), so it never needs to know how the model is split.
"""

from __future__ import annotations

import hashlib
import math
import threading
from typing import Mapping

import torch

from outer_optim.tensors import max_abs


class OuterOptimizer:
    """Holds θ_global (fp32, on ``device``) and applies outer steps to it.

    θ_global and the outer momentum are each one flat buffer, allocated once, in the order of ``params`` (the
    model's order: for an island holding every parameter whole, the canonical layout of :mod:`peers.island.layout`,
    so its buckets are views, never copies); :attr:`theta_global` holds per-name views of it.  The step is
    torch's SGD update (the same operations, in place): momentum ``buf ← μ·buf + Δ`` (from zeros), Nesterov
    ``update = Δ + μ·buf`` (else ``buf``; without momentum ``Δ``), ``θ ← θ − lr·update``.  On CUDA hosts the
    buffers are pinned, so that copies to and from a GPU run asynchronously."""

    def __init__(self, params: Mapping[str, torch.Tensor], lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True, device: str | torch.device = "cpu"):
        self.names = list(params)
        self.device = torch.device(device)
        """Where θ_global and the outer momentum live."""
        self.lr_, self.mu, self.nesterov = float(lr), float(momentum), bool(nesterov and momentum > 0)
        self.shapes = {n: tuple(p.shape) for n, p in params.items()}
        total = sum(p.numel() for p in params.values())
        pin = self.device.type == "cpu" and torch.cuda.is_available()
        self.flat = torch.empty(total, dtype=torch.float32, device=self.device, pin_memory=pin)
        """θ_global, flat, in the order of :attr:`names`."""
        self.flat_momentum = torch.zeros(total, dtype=torch.float32, device=self.device, pin_memory=pin) \
            if self.mu else torch.zeros(0)
        self.theta_global: dict[str, torch.Tensor] = self.views(self.flat)
        self._momentum = self.views(self.flat_momentum) if self.mu else {}
        with torch.no_grad():
            for n, p in params.items():
                self.theta_global[n].copy_(p.detach())
        self.step_count = 0
        largest = max((math.prod(shape) for shape in self.shapes.values()), default=0)
        self._update = torch.empty(largest if self.nesterov else 0, dtype=torch.float32, device=self.device)
        """Where the Nesterov update of one parameter is written, reused by every parameter: a fresh temporary
        per parameter paid its page faults each round (a second of a 1b island's round on the host)."""
        self.lock = threading.Lock()
        """Held while θ_global or the outer momentum change, so that a thread serving them reads one state."""
        self._magnitudes: tuple[int, int, dict[str, tuple[float, float]]] | None = None
        """(θ_global's version, the momentum's, name → (max |θ|, max |momentum|)) as :meth:`measure` found them."""

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-name views of a flat buffer laid out as θ_global (this rank's shards one after the other)."""
        out, pos = {}, 0
        for n in self.names:
            numel = math.prod(self.shapes[n])
            out[n] = flat[pos:pos + numel].view(self.shapes[n])
            pos += numel
        return out

    @classmethod
    def from_config(cls, params: Mapping[str, torch.Tensor], kind: str, lr: float, momentum: float,
                    device: str = "cpu") -> "OuterOptimizer":
        """`nesterov` uses (lr, momentum); `avg` is FedAvg: lr 1, no momentum; `sparseloco` is plain descent
        with lr (the error feedback of its codec stands in for momentum)."""
        if kind == "avg":
            return cls(params, lr=1.0, momentum=0.0, nesterov=False, device=device)
        if kind == "sparseloco":
            return cls(params, lr=lr, momentum=0.0, nesterov=False, device=device)
        if kind == "nesterov":
            return cls(params, lr=lr, momentum=momentum, nesterov=True, device=device)
        raise ValueError(f"unknown outer optimizer {kind!r}; use nesterov, avg or sparseloco")

    @property
    def lr(self) -> float:
        return self.lr_

    @torch.no_grad()
    def pseudo_gradient(self, local: Mapping[str, torch.Tensor], names: list[str] | None = None,
                        out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """``{name: Δ}`` with Δ = θ_global − θ_local, fp32 on the master device (of ``names``, None: all),
        written into ``out[name]`` when given (buffers allocated once, see :meth:`peers.island.exchange.BucketExchange.flat_views`)."""
        names = self.names if names is None else names
        if out is not None and names and local[names[0]].is_cuda and out[names[0]].is_pinned():
            return self._pseudo_gradient_from_device(local, names, out)
        deltas = {}
        for n in names:
            theta = self.theta_global[n]
            mine = local[n].detach().to(theta.device, torch.float32)
            deltas[n] = torch.sub(theta, mine, out=out[n]) if out is not None else theta - mine
        return deltas

    def _pseudo_gradient_from_device(self, local: Mapping[str, torch.Tensor], names: list[str],
                                     out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Δ of GPU parameters into pinned host buffers: every copy queued at once on a side stream (after the
        work already queued on the training stream), one wait, then θ_global − θ_local in place on the host.
        One transfer per parameter at the bus's rate, instead of a blocking ``.to("cpu")`` each."""
        device = local[names[0]].device
        copies = torch.cuda.Stream(device=device)
        copies.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(copies):
            for n in names:
                out[n].copy_(local[n].detach().reshape(out[n].shape), non_blocking=True)
        copies.synchronize()
        return {n: torch.sub(self.theta_global[n], out[n], out=out[n]) for n in names}

    @torch.no_grad()
    def step(self, averaged_delta: Mapping[str, torch.Tensor]) -> None:
        """Apply one outer step with the group's averaged ``{name: Δ}``; parameters missing from it (other
        Streaming DiLoCo fragments) keep their values and momentum.  Works in place, one parameter at a time:
        no temporary (the Nesterov update goes into one buffer of the largest parameter's size)."""
        for n in self.names:
            if n not in averaged_delta:
                continue
            theta = self.theta_global[n]
            d = averaged_delta[n].to(theta.device, torch.float32).reshape(theta.shape)
            if self.mu:
                buf = self._momentum[n]
                buf.mul_(self.mu).add_(d)
                update = torch.add(d, buf, alpha=self.mu, out=self._update[:d.numel()].view(d.shape)) \
                    if self.nesterov else buf
            else:
                update = d
            theta.add_(update, alpha=-self.lr_)
        self.step_count += 1

    @torch.no_grad()
    def step_is_finite(self, averaged_delta: Mapping[str, torch.Tensor]) -> bool:
        """Whether :meth:`step` with ``averaged_delta`` leaves θ_global finite (a finite Δ can still overflow
        with a huge learning rate), from bounds on each tensor's largest magnitude (no temporary): |θ'| ≤ |θ| +
        lr·((1+μ)·|Δ| + μ²·|buf|) with Nesterov, |θ| + lr·(|Δ| + μ·|buf|) without.  The magnitudes of θ_global and
        the momentum come from :meth:`measure` when nothing wrote to them since (their version counters say so),
        else are measured here."""
        limit = torch.finfo(torch.float32).max
        known = self._measured()
        for n, d in averaged_delta.items():
            a = max_abs(d)
            if n in known:
                t, m = known[n]
            else:
                t, m = max_abs(self.theta_global[n]), max_abs(self._momentum[n]) if self.mu else 0.0
            grow = (1 + self.mu) * a + self.mu * self.mu * m if self.nesterov else a + self.mu * m
            bound = t + self.lr_ * grow
            if not math.isfinite(bound) or bound >= limit:
                return False
        return True

    def _versions(self) -> tuple[int, int]:
        # every in-place write to a view of a flat buffer (a step, a copy_ of a download or a checkpoint) bumps the
        # version counter its views share with it
        return self.flat._version, self.flat_momentum._version

    def measure(self) -> None:
        """Measure the largest magnitude of each tensor of θ_global and the momentum now, for the next
        :meth:`step_is_finite`: called after a commit, beside training, it takes two passes over θ_global's size
        off the next blocking round (37.4 → 12.5 ms at 40M: ``benchmarks/overflow_check.py``).  A write meanwhile
        leaves nothing measured."""
        before = self._versions()
        found = {n: (max_abs(self.theta_global[n]), max_abs(self._momentum[n]) if self.mu else 0.0)
                 for n in self.names}
        if self._versions() == before:
            self._magnitudes = (*before, found)

    def _measured(self) -> dict[str, tuple[float, float]]:
        """What :meth:`measure` found, if nothing wrote to θ_global or the momentum since ({} otherwise)."""
        known = self._magnitudes
        return known[2] if known is not None and known[:2] == self._versions() else {}

    @torch.no_grad()
    def peek(self, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: θ}``: where :meth:`step` with ``delta`` would put θ_global, computed aside (neither
        θ_global nor the momentum change)."""
        out = {}
        for n, d in delta.items():
            theta = self.theta_global[n]
            d = d.to(theta.device, torch.float32).reshape(theta.shape)
            update = d
            if self.mu:
                buf = self._momentum[n] * self.mu + d
                update = d + self.mu * buf if self.nesterov else buf
            out[n] = theta - self.lr_ * update
        return out

    @torch.no_grad()
    def copy_to(self, local: Mapping[str, torch.Tensor], names: list[str] | None = None) -> None:
        """Overwrite the island's parameters with θ_global (cast to their dtype and device; of ``names``,
        None: all)."""
        names = self.names if names is None else names
        asynchronous = bool(names) and local[names[0]].is_cuda and self.flat.is_pinned()
        for n in names:
            local[n].copy_(self.theta_global[n], non_blocking=asynchronous)
        if asynchronous:  # θ_global may change on the host once this returns: the copies must have read it
            torch.cuda.current_stream(local[names[0]].device).synchronize()

    def momentum_buffers(self) -> list[torch.Tensor]:
        """Momentum of each parameter (zeros before the first step; views, not copies), same order as
        :attr:`names`."""
        if not self.mu:
            return [torch.zeros(self.shapes[n]) for n in self.names]
        return [self._momentum[n] for n in self.names]

    @torch.no_grad()
    def set_momentum_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Install momentum downloaded from a peer."""
        if not self.mu:
            return
        for n, b in zip(self.names, buffers):
            self._momentum[n].copy_(b.reshape(self.shapes[n]))

    def state_dict(self) -> dict:
        """θ_global, momentum and step count (for checkpoints; copies)."""
        return {"master": {n: t.detach().clone() for n, t in self.theta_global.items()},
                "momentum": [b.clone() for b in self.momentum_buffers()], "step_count": self.step_count,
                "lr": self.lr}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        missing = set(self.names) ^ set(state["master"])
        if missing:
            raise ValueError(f"outer optimizer state does not match the model (differing names: {sorted(missing)[:3]})")
        for n in self.names:
            self.theta_global[n].copy_(state["master"][n])
        self.set_momentum_buffers(list(state["momentum"]))
        self.step_count = int(state["step_count"])


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """A short hash of named tensors rounded to bf16 (in the mapping's order), to compare whole
    models cheaply: θ_global of islands of any shape, the baseline's parameters."""
    h = hashlib.sha1()
    for t in tensors.values():
        h.update(t.detach().cpu().to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]

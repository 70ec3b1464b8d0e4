"""The outer optimizer of DiLoCo: an fp32 master copy of θ_global stepped by averaged pseudo-gradients.

Pseudo-gradient Δ = θ_global − θ_local points from where the island ended towards where it started,
so a plain SGD step with lr 1 on Δ lands exactly on θ_local (FedAvg); Nesterov momentum on Δ is
the DiLoCo default.  The optimizer works on named tensors (this rank's local shards under tensor or
pipeline parallelism), so it never needs to know how the model is split.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Mapping

import torch


class OuterOptimizer:
    """Holds θ_global (fp32, on ``device``) and applies outer steps to it."""

    def __init__(self, params: Mapping[str, torch.Tensor], lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True, device: str | torch.device = "cpu"):
        self.names = list(params)
        self.theta_global: dict[str, torch.Tensor] = {
            n: p.detach().to(device=device, dtype=torch.float32, copy=True) for n, p in params.items()}
        for t in self.theta_global.values():
            t.requires_grad_(True)
        self.optimizer = torch.optim.SGD(list(self.theta_global.values()), lr=lr, momentum=momentum,
                                         nesterov=nesterov and momentum > 0)
        self.step_count = 0
        self.lock = threading.Lock()
        """Held while θ_global or the outer momentum change, so that a thread serving them reads one state."""

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
        return float(self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def pseudo_gradient(self, local: Mapping[str, torch.Tensor], names: list[str] | None = None
                        ) -> dict[str, torch.Tensor]:
        """``{name: Δ}`` with Δ = θ_global − θ_local, fp32 on the master device (of ``names``, None: all)."""
        return {n: self.theta_global[n].detach() - local[n].detach().to(self.theta_global[n].device, torch.float32)
                for n in (self.names if names is None else names)}

    @torch.no_grad()
    def step(self, averaged_delta: Mapping[str, torch.Tensor]) -> None:
        """Apply one outer step with the group's averaged ``{name: Δ}``; parameters missing from it (other
        Streaming DiLoCo fragments) keep their values and momentum."""
        for n in self.names:
            if n not in averaged_delta:
                continue
            self.theta_global[n].grad = averaged_delta[n].to(self.theta_global[n].device, torch.float32).reshape(
                self.theta_global[n].shape)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1

    @torch.no_grad()
    def step_is_finite(self, averaged_delta: Mapping[str, torch.Tensor]) -> bool:
        """Whether :meth:`step` with ``averaged_delta`` leaves θ_global finite (a finite Δ can still
        overflow with a huge learning rate): computed aside, one tensor at a time, nothing changed."""
        return all(bool(torch.isfinite(self._stepped(n, d)).all()) for n, d in averaged_delta.items())

    @torch.no_grad()
    def peek(self, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: θ}``: where :meth:`step` with ``delta`` would put θ_global, computed aside (neither
        θ_global nor the momentum change)."""
        return {n: self._stepped(n, d) for n, d in delta.items()}

    def _stepped(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """θ_global[name] after an outer step with ``delta`` (torch's SGD update, on copies)."""
        group = self.optimizer.param_groups[0]
        lr, mu, nesterov = group["lr"], group["momentum"], group["nesterov"]
        p = self.theta_global[name]
        d = delta.to(p.device, torch.float32).reshape(p.shape)
        update = d
        if mu:
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            buf = d if buf is None else buf * mu + d
            update = d + mu * buf if nesterov else buf
        return p.detach() - lr * update

    @torch.no_grad()
    def copy_to(self, local: Mapping[str, torch.Tensor], names: list[str] | None = None) -> None:
        """Overwrite the island's parameters with θ_global (cast to their dtype and device; of ``names``,
        None: all)."""
        for n in (self.names if names is None else names):
            local[n].copy_(self.theta_global[n])

    def momentum_buffers(self) -> list[torch.Tensor]:
        """Momentum of each parameter (zeros before the first step), same order as :attr:`names`."""
        out = []
        for n in self.names:
            buf = self.optimizer.state.get(self.theta_global[n], {}).get("momentum_buffer")
            out.append(buf.detach() if buf is not None else torch.zeros_like(self.theta_global[n]))
        return out

    @torch.no_grad()
    def set_momentum_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Install momentum downloaded from a peer."""
        for n, b in zip(self.names, buffers):
            p = self.theta_global[n]
            self.optimizer.state[p]["momentum_buffer"] = b.to(p.device, torch.float32).reshape(p.shape).clone()

    def state_dict(self) -> dict:
        """θ_global, momentum and step count (for checkpoints)."""
        return {"master": {n: t.detach().clone() for n, t in self.theta_global.items()},
                "momentum": self.momentum_buffers(), "step_count": self.step_count,
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

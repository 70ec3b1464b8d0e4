"""One DiLoCo island: H inner AdamW steps, then a verified outer round with the other islands.

The outer round is a transaction (as in torchft): compute Δ = θ_global − θ_local, average it with the
group, and either commit (outer optimizer step, restart inner training from the new θ_global) or,
when the round failed, roll back to where we were — θ_global untouched, the island keeps training
from its own parameters and the next round carries the accumulated Δ.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from diloco import checkpoint
from diloco.config import AveragingConfig, Config, flatten, to_dict
from diloco.data import ShardedBatches, heldout_batches, load_corpus
from diloco.inner import build_inner_optimizer
from diloco.metrics import MetricsLogger
from diloco.model import build_model, lm_loss
from diloco.faults import FaultPlan
from outer_optim import OuterOptimizer
from outer_optim.guard import NormGuard
from peers.averager import AveragerSettings, IslandAverager, fingerprint, fingerprints_agree
from peers.dht import NetworkSettings, PeerNetworkError, start_dht, visible_maddrs
from peers.local import LocalAverager
from peers.membership import Membership, new_run_key, wait_until

log = logging.getLogger("diloco")

STATE_FINGERPRINT_CHUNKS = 16

# Keys that must be equal on every island of a run for their pseudo-gradients to be averaged.
FINGERPRINT_PREFIXES = ("model.", "seed", "diloco.outer_optimizer", "diloco.outer_lr", "diloco.outer_momentum",
                        "averaging.compression", "averaging.run_id")


class TrainingError(RuntimeError):
    """The island cannot continue; the message says why and what to do."""


def needs_parallel_island(cfg: Config) -> bool:
    """Whether this island runs as :class:`diloco.parallel_island.ParallelIsland` (tp/pp processes,
    shard-wise averaging, or a torchrun world) rather than the single-process :class:`Island`."""
    return (cfg.parallel.tp * cfg.parallel.pp > 1 or cfg.averaging.sharded
            or cfg.averaging.backend in ("torch", "auto") or int(os.environ.get("WORLD_SIZE", "1")) > 1)


class NullMetrics:
    """Stands in for :class:`MetricsLogger` on the ranks of an island that do not write metrics."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def config_fingerprint(cfg: Config) -> str:
    """Hash of the settings islands must share (model shape, outer optimizer, wire format, run id)."""
    shared = {k: v for k, v in flatten(cfg).items() if k.startswith(FINGERPRINT_PREFIXES)}
    return hashlib.sha1(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:12]


def pick_device(spec: str) -> torch.device:
    """`auto` → CUDA if available (the local rank's GPU under torchrun), else CPU."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    return torch.device(spec)


@dataclass
class IslandStats:
    """Running totals of one island, reported at the end and kept in checkpoints."""

    rounds_ok: int = 0
    rounds_failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    tokens: int = 0
    eval_loss_start: float = float("nan")
    eval_loss_end: float = float("nan")
    failures: list[str] = field(default_factory=list)


class Island:
    """Everything one island owns: model, data shard, inner and outer optimizers, averager, logs.

    This is the single-process island; :class:`diloco.parallel_island.ParallelIsland` overrides the
    rank-aware parts (model, averaging, state, checkpoints) for islands of tp x pp processes.
    """

    is_main = True
    """Whether this process writes the island's metrics, summary and files and prints (rank 0)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir or self.run_dir / "checkpoints")
        self.name = f"{cfg.averaging.run_id}-island{cfg.data.shard_index}"
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = pick_device(cfg.device)
        torch.manual_seed(cfg.seed)
        corpus = load_corpus(cfg.data)
        log.info("data: %s", corpus.description)
        m = cfg.model
        self.batches = ShardedBatches(corpus.train, m.seq_len, cfg.inner.batch_size, cfg.data.shard_index,
                                      cfg.data.num_shards, cfg.seed)
        self.eval_batches = heldout_batches(corpus.heldout, m.seq_len, cfg.inner.batch_size,
                                            cfg.logging.eval_batches)
        self.model, self.params, inner_params = self._build_model()
        total_inner = cfg.diloco.outer_steps * cfg.diloco.inner_steps
        self.inner_opt, self.inner_sched = build_inner_optimizer(inner_params, cfg.inner, total_inner)
        d = cfg.diloco
        self.outer = OuterOptimizer.from_config(self.params, d.outer_optimizer, d.outer_lr, d.outer_momentum,
                                                device=d.master_device)
        self.outer_step = 0
        self.inner_step = 0
        self.stats = IslandStats()
        self.fingerprint = config_fingerprint(cfg)
        self._state_lock = threading.Lock()
        self._stop = threading.Event()
        self.dht = None
        self.averager: IslandAverager | LocalAverager | None = None
        self.membership: Membership | None = None
        self.metrics: MetricsLogger | None = None
        self.guard = NormGuard(cfg.averaging.max_norm_ratio)
        self.faults = FaultPlan.from_env()
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else nullcontext())
        self._stopping = False

    def _build_model(self) -> tuple[Any, dict[str, torch.Tensor], list[tuple[str, torch.nn.Parameter]]]:
        """(model, ``{name: tensor}`` the outer optimizer works on, named parameters of the inner optimizer)."""
        model = build_model(self.cfg.model, seed=self.cfg.seed)
        if self.cfg.checkpoint.init_from:
            checkpoint.init_parameters(model, self.cfg.checkpoint.init_from)
        model = model.to(self.device)
        model.activation_checkpointing = self.cfg.parallel.activation_checkpointing
        params = dict(model.named_parameters())
        return model, params, list(params.items())

    # ------------------------------------------------------------------ peers
    def connect(self) -> None:
        """Start the averager (hivemind or local) and print the command line others can join with."""
        a = self.cfg.averaging
        if a.backend == "local":
            self.averager = LocalAverager()
            return
        run_key = resolve_run_key(a, new_run_key)
        self.dht = start_dht(NetworkSettings(
            initial_peers=a.initial_peers, host_maddrs=a.host_maddrs, announce_maddrs=a.announce_maddrs,
            identity_path=a.identity_path, client_mode=a.client_mode, startup_timeout=a.startup_timeout,
            run_key="" if a.public else run_key))
        self.averager = IslandAverager(self.dht, list(self.outer.master.values()), averager_settings(a),
                                       state_provider=self.global_state)
        self.membership = Membership(self.dht, a.run_id, ttl=a.member_ttl)
        self.membership.start_heartbeat()
        announce_join(self.name, self.dht, a, run_key)

    def global_state(self) -> tuple[dict, list[torch.Tensor]]:
        """θ_global, outer momentum and outer step, served to islands that join (runs in a helper thread)."""
        return self._outer_snapshot(lambda: {"state_fingerprint": self.state_fingerprint()})

    def _outer_snapshot(self, extra_meta: Callable[[], dict[str, Any]]) -> tuple[dict, list[torch.Tensor]]:
        """(meta, θ_global tensors + outer momentum buffers), taken under the state lock; ``extra_meta``
        adds the caller's own fields (evaluated under the lock too)."""
        with self._state_lock:
            meta = {"outer_step": self.outer_step, "config_fingerprint": self.fingerprint,
                    "names": self.outer.names, **extra_meta()}
            tensors = [t.detach().clone() for t in self.outer.master.values()]
            tensors += [b.clone() for b in self.outer.momentum_buffers()]
        return meta, tensors

    def state_fingerprint(self) -> list[float]:
        """Coarse, rounding-tolerant summary of θ_global that travels with every round."""
        return fingerprint(list(self.outer.master.values()), STATE_FINGERPRINT_CHUNKS)

    def join_from_peers(self) -> bool:
        """Before training: wait for the expected islands, then catch up with the run if it moved on."""
        a = self.cfg.averaging
        if self.membership is not None and a.wait_for_islands > 1:
            ok = wait_until(lambda: self.membership.live_count() >= a.wait_for_islands, a.matchmaking_timeout)
            log.info("%d of %d expected islands registered%s", self.membership.live_count(), a.wait_for_islands,
                     "" if ok else " (gave up waiting)")
        if not a.initial_peers or self.membership is None:
            return False
        others = self.membership.others()
        check_same_averaging(others, sharded=False)
        if all(m.outer_step <= self.outer_step and not m.averaging for m in others):
            return False  # the run has not moved past us: θ_0 comes from the shared seed
        return self.catch_up(force_download=True)

    def catch_up(self, force_download: bool = False) -> bool:
        """If other islands are ahead of us, adopt the freshest θ_global, outer momentum and outer step.

        When the others are averaging the round that state belongs to, wait for that round to
        commit (bounded), so that we start the next round together with them rather than one behind.
        ``force_download`` checks with the peers even if none announced a later step.
        """
        if not self._can_download():
            return False
        if not self._main_decides(lambda: force_download or self.membership.furthest_step() > self.outer_step):
            return False
        a = self.cfg.averaging
        deadline = time.monotonic() + a.matchmaking_timeout + a.allreduce_timeout + a.vote_timeout
        first = None
        while True:
            state = self._download_global_state()
            step = int(state[0].get("outer_step", 0)) if state is not None else -1
            retry = self._main_decides(lambda: state is None and self.membership.furthest_step() > self.outer_step
                                       and time.monotonic() < deadline)
            if retry:
                time.sleep(1.0)  # others are ahead but busy or unreachable right now: ask again
                continue
            if step <= self.outer_step:
                if step < 0:
                    log.info("no peer served its state; keeping ours (outer step %d)", self.outer_step)
                return False
            first = step if first is None else first
            # wait for the round in flight when we first looked (committed or failed), not for later ones
            wait = self._main_decides(lambda: step == first and self.membership.averaging_round(step)
                                      and time.monotonic() <= deadline)
            if not wait:
                break
            time.sleep(0.5)  # the round that state belongs to is in flight: take its result instead
        self.adopt_state(*state)
        self.averager.set_state_priority(self.outer_step)
        self.membership.announce(self.outer_step, averaging=False)
        log.info("caught up with the run at outer step %d (θ_global downloaded from peers)", self.outer_step)
        return True

    def _main_decides(self, decide: Callable[[], Any]) -> Any:
        """Evaluate a decision about the run (membership lookups, clocks); a multi-rank island takes its
        main rank's answer on every rank."""
        return decide()

    def _can_download(self) -> bool:
        """Whether this island can download θ_global from peers (it has a DHT and an averager)."""
        return self.membership is not None and self.averager is not None

    def _download_global_state(self, target: list[float] | None = None) -> tuple[dict, list[torch.Tensor]] | None:
        """A peer's ``(meta, θ_global + outer momentum)``, or None if no peer served one or, with
        ``target`` (a state fingerprint), if the downloaded θ_global does not match it."""
        state = self.averager.download_state()
        if state is None or target is None:
            return state
        downloaded = fingerprint(state[1][:len(self.outer.names)], STATE_FINGERPRINT_CHUNKS)
        return state if fingerprints_agree(downloaded, target, 1e-5) else None

    def adopt_state(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        """Install a peer's θ_global, outer momentum and outer step; restart inner training from θ_global."""
        if meta.get("config_fingerprint") != self.fingerprint:
            raise TrainingError(
                f"the run you joined uses a different model or outer-optimizer config (fingerprint "
                f"{meta.get('config_fingerprint')} vs ours {self.fingerprint}); use the same --model.*, --seed and "
                f"--diloco.outer_* settings as the other islands")
        n = len(self.outer.names)
        shapes_ok = len(tensors) == 2 * n and all(
            t.shape == p.shape for t, p in zip(tensors[:n], self.outer.master.values()))
        if not shapes_ok or not all(torch.isfinite(t).all() for t in tensors):
            raise TrainingError("the state downloaded from a peer does not match this model's parameter shapes "
                                "or is not finite; use the same --model.* settings as the other islands")
        with self._state_lock, torch.no_grad():
            for t, m in zip(tensors[:n], self.outer.master.values()):
                m.copy_(t)
            self.outer.set_momentum_buffers(tensors[n:])
            self.outer.step_count = int(meta.get("outer_step", 0))
            self.outer_step = int(meta.get("outer_step", 0))
        self.outer.copy_to(self.params)

    def resync(self, gathered: dict[str, dict], majority: list[str], attempts: int = 3) -> bool:
        """We hold a θ_global the majority does not: download theirs, verified against the majority's
        state fingerprint."""
        if not self._can_download():
            log.warning("θ_global differs from the majority's and this island cannot download state; "
                        "continuing with ours")
            return False
        target = gathered[majority[0]].get("state_fingerprint")
        self.averager.set_state_priority(-1)  # nobody should download our stale state meanwhile
        try:
            for attempt in range(attempts):
                state = self._download_global_state(target)
                if state is not None:
                    self.adopt_state(*state)
                    log.warning("resynchronized θ_global from the majority (outer step %d)", self.outer_step)
                    return True
                log.warning("resync attempt %d/%d did not get the majority's state", attempt + 1, attempts)
            return False
        finally:
            self.averager.set_state_priority(self.outer_step)

    # --------------------------------------------------------------- training
    def train_step(self) -> float:
        """One inner AdamW step (with gradient accumulation); returns the mean loss."""
        self.model.train()
        accum = self.cfg.inner.grad_accum
        total = 0.0
        for _ in range(accum):
            x, y = self.batches.next_batch()
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast:
                loss = lm_loss(self.model(x), y) / accum
            loss.backward()
            total += loss.item()
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self._optimizer_step(accum)
        return total

    def _optimizer_step(self, accum: int) -> None:
        """Apply the accumulated gradients: AdamW step, schedule step, counters."""
        self.inner_opt.step()
        self.inner_sched.step()
        self.inner_opt.zero_grad(set_to_none=True)
        self.inner_step += 1
        self.stats.tokens += self.batches.tokens_per_batch * accum

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over the fixed evaluation batches."""
        self.model.eval()
        losses = []
        for x, y in self.eval_batches:
            with self.autocast:
                losses.append(lm_loss(self.model(x.to(self.device)), y.to(self.device)).item())
        return float(np.mean(losses))

    def outer_round(self, tokens_in_round: int) -> dict[str, Any]:
        """Snapshot, average, validate, then commit the outer step or roll back; returns round metrics.

        Rolling back means θ_global stays as it was and this island keeps training from its own
        parameters, so the next round carries the pseudo-gradient of both rounds.
        """
        if self.catch_up():
            # the others moved on without us: our inner steps are dropped, never sent as a stale Δ
            self.stats.rounds_failed += 1
            self.stats.failures.append(f"round {self.outer_step}: behind the run, caught up from a peer")
            return {"round_ok": 0, "num_peers": 0, "pseudo_grad_norm": float("nan"),
                    "averaged_pseudo_grad_norm": float("nan"), "allreduce_seconds": 0.0,
                    "bytes_sent": self.stats.bytes_sent, "bytes_received": self.stats.bytes_received,
                    "outer_lr": self.outer.lr, "round_failure": "behind the run; caught up from a peer",
                    "averaging_backend": "none", "used_fallback": 0}
        rnd = self.outer_step
        if self.faults.has("drift", "theta", rnd):
            with self._state_lock, torch.no_grad():
                for m in self.outer.master.values():
                    m.add_(1e-3)
        delta = self.outer.pseudo_gradient(self.params)
        if self.faults.has("scale", "send", rnd):
            delta = [d * 1e6 for d in delta]
        local_norm = self._global_norm(delta)
        meta = {"outer_step": rnd, "config_fingerprint": self.fingerprint,
                "state_fingerprint": self.state_fingerprint()}
        if self.membership is not None:
            self.membership.announce(rnd, averaging=True)
        result, averaged = self._average(delta, float(tokens_in_round), meta, rnd)
        reason = result.reason
        avg_norm = self._global_norm(averaged) if averaged is not None else float("nan")
        if result.ok:
            reason = self.guard.check(avg_norm)
        if not reason:
            with self._state_lock:
                self.outer.step(averaged)
                self.outer_step += 1
            self.outer.copy_to(self.params)
            self.guard.record(avg_norm)
            self._after_commit()
            self.stats.rounds_ok += 1
        else:
            self.outer_step += 1  # stay aligned with the others' round numbering
            self._after_rollback()
            self.stats.rounds_failed += 1
            self.stats.failures.append(f"round {rnd}: {reason}")
            log.warning("round %d rolled back (%s); continuing from this island's own parameters", rnd, reason)
            if result.in_minority:
                self.resync(result.gathered, result.majority_peers)
        if self.membership is not None:
            self.membership.announce(self.outer_step, averaging=False)
        self.stats.bytes_sent += result.bytes_sent
        self.stats.bytes_received += result.bytes_received
        self.stats.comm_seconds += result.seconds
        return {"round_ok": int(not reason), "num_peers": result.group_size, "pseudo_grad_norm": local_norm,
                "averaged_pseudo_grad_norm": avg_norm, "allreduce_seconds": result.seconds,
                "bytes_sent": self.stats.bytes_sent, "bytes_received": self.stats.bytes_received,
                "outer_lr": self.outer.lr, "round_failure": reason,
                "averaging_backend": self._backend_used(result),
                "used_fallback": int(bool(getattr(result, "fallback_reason", "")))}

    # ------------------------------------------------- hooks (overridden by ParallelIsland)
    def _average(self, delta: list[torch.Tensor], weight: float, meta: dict, rnd: int) -> tuple[Any, Any]:
        """One averaging round of this island's Δ (in :attr:`outer.names` order): (result, averaged Δ or None)."""
        return self.averager.average(delta, weight, meta, round_id=str(rnd),
                                     on_stage=lambda phase: self.faults.at(phase, rnd))

    def _global_norm(self, tensors: list[torch.Tensor]) -> float:
        """L2 norm of the island's whole Δ (over all its ranks)."""
        return _norm(tensors)

    def _after_commit(self) -> None:
        """After an outer step was applied: advertise the fresher state to joining islands."""
        self.averager.set_state_priority(self.outer_step)

    def _after_rollback(self) -> None:
        """After a failed round moved the round number on (θ_global unchanged): keep advertising our
        state as current, so joiners prefer live islands to the stale records of departed ones."""
        self.averager.set_state_priority(self.outer_step)

    def _backend_used(self, result: Any) -> str:
        """Which averaging path produced this round's result (metric ``averaging_backend``)."""
        return self.cfg.averaging.backend

    def _stop_agreed(self) -> bool:
        """Whether to stop now (a stop was requested); every rank of an island gets the same answer."""
        self._stopping = self._stop.is_set()
        return self._stopping

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this island exactly."""
        return {
            "config": to_dict(self.cfg), "outer_step": self.outer_step, "inner_step": self.inner_step,
            "model": self._model_state(),
            "inner_optimizer": self.inner_opt.state_dict(), "inner_scheduler": self.inner_sched.state_dict(),
            "outer_optimizer": self.outer.state_dict(), "data": self.batches.state_dict(),
            "rng": rng_state(), "stats": {k: v for k, v in self.stats.__dict__.items()},
            "norm_history": list(self.guard.history),
        }

    def _model_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.model.load_state_dict(state["model"])
        self.inner_opt.load_state_dict(state["inner_optimizer"])
        self._load_training_state(state)

    def _load_training_state(self, state: dict[str, Any]) -> None:
        """Restore everything of :meth:`state_dict` but the model and the inner optimizer."""
        self.inner_sched.load_state_dict(state["inner_scheduler"])
        self.outer.load_state_dict(state["outer_optimizer"])
        self.batches.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.outer_step, self.inner_step = int(state["outer_step"]), int(state["inner_step"])
        for k, v in state["stats"].items():
            setattr(self.stats, k, v)
        self.guard.history = [float(x) for x in state.get("norm_history", [])]

    def save_checkpoint(self) -> Path:
        path = checkpoint.save(self.state_dict(), checkpoint.checkpoint_path(self.ckpt_dir, self.outer_step),
                               keep=self.cfg.checkpoint.keep)
        log.info("checkpoint written: %s", path)
        return path

    def maybe_resume(self) -> None:
        path = checkpoint.find_resume(self.cfg.checkpoint.resume, self.ckpt_dir)
        if path is None:
            return
        state = checkpoint.load(path)
        saved = state.get("config", {})
        saved_fp = config_fingerprint(_config_from(saved)) if saved else self.fingerprint
        if saved_fp != self.fingerprint:
            raise TrainingError(f"checkpoint {path} was written with a different model or outer-optimizer "
                                f"config; resume with the same --model.* and --diloco.outer_* settings")
        self.load_state_dict(state)
        log.info("resumed from %s at outer step %d", path, self.outer_step)

    # ------------------------------------------------------------------- loop
    def request_stop(self, *_: Any) -> None:
        """Finish the current inner step, checkpoint and leave (SIGINT/SIGTERM)."""
        if not self._stop.is_set() and self.is_main:
            print(f"[{self.name}] stopping: finishing the current step and writing a checkpoint", flush=True)
        self._stop.set()

    def run(self) -> dict[str, Any]:
        """Train until ``diloco.outer_steps`` rounds are done (or a stop is requested)."""
        cfg = self.cfg
        self.maybe_resume()
        main_thread = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
        self.connect()
        # hivemind's averager makes this process ignore SIGINT: install ours after it started,
        # and give the previous handlers back when the island is done
        for sig in previous:
            signal.signal(sig, self.request_stop)
        w = cfg.wandb
        self.metrics = MetricsLogger(self.run_dir, wandb_mode=w.mode, project=w.project,
                                     group=w.group or cfg.averaging.run_id, name=self.name, entity=w.entity,
                                     config=to_dict(cfg)) if self.is_main else NullMetrics()
        try:
            self.join_from_peers()
            return self._loop()
        finally:
            self.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> dict[str, Any]:
        cfg, H = self.cfg, self.cfg.diloco.inner_steps
        t_start = time.perf_counter()
        if self.outer_step == 0 and math.isnan(self.stats.eval_loss_start):
            self.stats.eval_loss_start = self.evaluate()
            self.metrics.log({"eval/loss": self.stats.eval_loss_start,
                              "eval/perplexity": math.exp(self.stats.eval_loss_start),
                              "tokens": self.stats.tokens, "outer_step": self.outer_step})
        tokens_at_commit = self.stats.tokens
        while self.outer_step < cfg.diloco.outer_steps and not self._stop_agreed():
            t_round = time.perf_counter()
            window_t, window_tokens = time.perf_counter(), self.stats.tokens
            for h in range(H):
                if h == H // 2:
                    self.faults.at("inner", self.outer_step)
                loss = self.train_step()
                if (h + 1) % cfg.logging.log_every == 0 or h == H - 1:
                    now = time.perf_counter()
                    self.metrics.log({"loss": loss, "perplexity": math.exp(min(loss, 50)),
                                      "lr": self.inner_sched.get_last_lr()[0], "tokens": self.stats.tokens,
                                      "tokens_per_second": (self.stats.tokens - window_tokens) / (now - window_t),
                                      "outer_step": self.outer_step, "inner_step": self.inner_step})
                    window_t, window_tokens = now, self.stats.tokens
                if self._stop_agreed():
                    break
            self.stats.compute_seconds += time.perf_counter() - t_round
            if self._stopping:
                break
            round_metrics = self.outer_round(self.stats.tokens - tokens_at_commit)
            if round_metrics["round_ok"]:
                tokens_at_commit = self.stats.tokens
            record = dict(round_metrics, tokens=self.stats.tokens, outer_step=self.outer_step, loss=loss)
            if self.outer_step % cfg.logging.eval_every == 0 or self.outer_step == cfg.diloco.outer_steps:
                t_eval = time.perf_counter()
                ev = self.evaluate()
                self.stats.compute_seconds += time.perf_counter() - t_eval
                self.stats.eval_loss_end = ev
                record.update({"eval/loss": ev, "eval/perplexity": math.exp(ev)})
            wall = time.perf_counter() - t_start
            record["compute_utilization"] = self.stats.compute_seconds / max(wall, 1e-9)
            self.metrics.log(record)
            status = "ok" if round_metrics["round_ok"] else f"FAILED ({round_metrics['round_failure']})"
            via = round_metrics.get("averaging_backend", "")
            if self.is_main:
                print(f"[{self.name}] round {self.outer_step}/{cfg.diloco.outer_steps} {status} "
                      f"peers={round_metrics['num_peers']} loss={loss:.3f}"
                      + (f" eval={record['eval/loss']:.3f}" if "eval/loss" in record else "")
                      + (f" via={via}" if via in ("torch", "auto") else ""), flush=True)
            if cfg.checkpoint.every and self.outer_step % cfg.checkpoint.every == 0:
                self.save_checkpoint()
        if self._stop_agreed() or (cfg.checkpoint.every and self.outer_step % cfg.checkpoint.every):
            self.save_checkpoint()
        if math.isnan(self.stats.eval_loss_end):
            self.stats.eval_loss_end = self.evaluate()
        return self._finish(time.perf_counter() - t_start)

    def _theta_global(self) -> tuple[dict[str, torch.Tensor] | None, str]:
        """The whole θ_global (None on ranks that do not write it) and its checksum."""
        return {n: t.detach().clone() for n, t in self.outer.master.items()}, self.outer.checksum()

    def _finish(self, wall: float) -> dict[str, Any]:
        theta, checksum = self._theta_global()
        if self.is_main:
            torch.save(theta, self.run_dir / "theta_global.pt")
        s = self.stats
        summary = {
            "island": self.name, "outer_step": self.outer_step, "inner_step": self.inner_step, "tokens": s.tokens,
            "eval_loss_start": s.eval_loss_start, "eval_loss_end": s.eval_loss_end,
            "rounds_ok": s.rounds_ok, "rounds_failed": s.rounds_failed, "bytes_sent": s.bytes_sent,
            "bytes_received": s.bytes_received, "compute_seconds": s.compute_seconds,
            "comm_seconds": s.comm_seconds, "wall_seconds": wall, "theta_checksum": checksum,
            "failures": s.failures[-20:], "stopped_early": self._stopping,
        }
        self.metrics.summary(summary)
        return summary

    def close(self) -> None:
        """Announce leaving, stop the averager, the DHT and the W&B run (idempotent)."""
        if self.membership is not None:
            self.membership.leave()
            self.membership = None
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def resolve_run_key(a: AveragingConfig, generate: Callable[[], str]) -> str:
    """The run key this island uses: the configured one, or (first island of a private run) ``generate()``.

    An island joining a private run without the key cannot be let in: say how to get it.
    """
    if a.public or a.run_key:
        return a.run_key
    if a.initial_peers:
        raise TrainingError("this run is private: pass --averaging.run_key KEY as printed by the island "
                            "that started it (or --averaging.public true if the run is public)")
    return generate()


def averager_settings(a: AveragingConfig, **extra: Any) -> AveragerSettings:
    """The averager's narrow settings from the island's averaging config (``extra``: per-island fields)."""
    return AveragerSettings(
        prefix=a.run_id, min_group_size=a.min_group_size, target_group_size=a.target_group_size,
        matchmaking_time=a.matchmaking_time, matchmaking_timeout=a.matchmaking_timeout,
        allreduce_timeout=a.allreduce_timeout, next_chunk_timeout=a.next_chunk_timeout,
        request_timeout=a.request_timeout, vote_timeout=a.vote_timeout,
        state_download_timeout=a.state_download_timeout, compression=a.compression,
        client_mode=a.client_mode, private=not a.public, **extra)


def announce_join(name: str, dht: Any, a: AveragingConfig, run_key: str) -> None:
    """Print the line other islands join with; write the addresses to ``maddr_file`` (atomically) if set."""
    maddrs = visible_maddrs(dht)
    key = "" if a.public else f" --averaging.run_key {run_key}"
    print(f"[{name}] other islands can join with --initial-peers {','.join(maddrs)}{key}", flush=True)
    if a.maddr_file:
        tmp = Path(a.maddr_file + ".tmp")
        tmp.write_text("\n".join(maddrs) + "\n")
        os.replace(tmp, a.maddr_file)


def check_same_averaging(others: list[Any], sharded: bool) -> None:
    """Raise TrainingError when a live island of the run averages differently (shard-wise or not):
    such islands never meet in a group."""
    odd = [m for m in others if bool(getattr(m, "sharded", False)) != sharded]
    if not odd:
        return
    if sharded:
        raise TrainingError(f"{len(odd)} island(s) of this run average their parameters as a whole, not shard-wise "
                            f"like this tensor/pipeline-parallel one: restart them with --averaging.sharded true")
    raise TrainingError(f"{len(odd)} island(s) of this run average shard-wise (tensor/pipeline-parallel islands): "
                        f"restart this island with --averaging.sharded true")


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as checkpoint-safe plain types and tensors."""
    np_state = np.random.get_state()
    state = {"python": repr(random.getstate()), "torch": torch.get_rng_state(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    import ast

    random.setstate(_tuplify(ast.literal_eval(state["python"])))
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(i) for i in x) if isinstance(x, (list, tuple)) else x


def _config_from(data: dict[str, Any]) -> Config:
    from diloco.config import from_dict

    return from_dict(data)


def train(cfg: Config) -> dict[str, Any] | None:
    """Run one island to completion; return its summary on the island's main rank (None on the other
    ranks of a tp/pp island, which would only repeat it)."""
    if needs_parallel_island(cfg):
        from diloco.parallel_island import ParallelIsland

        island: Island = ParallelIsland(cfg)
    else:
        island = Island(cfg)
    summary = island.run()
    return summary if island.is_main else None


__all__ = ["Island", "train", "TrainingError", "PeerNetworkError", "config_fingerprint", "needs_parallel_island"]

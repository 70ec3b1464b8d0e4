"""``diloco plan``: from servers, GPUs and a link to the fastest run within a loss budget, predicted from measured
figures, with the command line of every server.

    diloco plan --model.preset 1b --servers 2 --gpus 8 --gpu h100 --link 1gbit --rtt 50 --tokens 20B --price 2.5
    diloco plan --model.preset 1b --probe probe.json   # the link as `diloco probe` measured it
    diloco plan --config my.toml                       # the model of a train config (--model.* keys alike)

It predicts, for every candidate (island shape, H, codec, overlap, fragments) and for the synchronous
alternative (HSDP: FSDP inside each server, gradients all-reduced across servers every step):

- compute: the MFU measured for one GPU of that kind (``experiments/results/gpu-island*``), scaled by the
  data sheet's peak, less the pipeline bubble and the tensor-parallel traffic over NVLink (data sheet: no
  multi-GPU measurement exists yet), and the memory each GPU needs (weights, gradients, AdamW and activations
  fitted to the measured peak memory);
- a round: the bytes each island sends for the codec and group size (:mod:`outer_optim.compression`), over the link
  rate of as many TCP streams as the island has ranks, plus the fixed cost and round trips measured by
  ``experiments/results/latency``, plus the outer state's work measured in a running island (``gpu-run-h100*``;
  blocking rounds keep the outer state on the GPU when it fits there, where that work is 26 times shorter);
- compute utilization: what the round adds to the H inner steps (all of it when blocking; what H steps cannot
  hide when the round is in flight, plus the hand-over measured by ``round-stall``);
- the loss penalty against synchronous training: the published gap of DiLoCo by model size, H and islands
  (``results/published/loss-gaps.json``) plus what codecs and overlap measured here (``horizon-12*``), with
  an uncertainty.

Every constant is named with the file it came from at the end of the output; anything assumed is marked.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, config_for, run_command
from diloco.config import ConfigError
from diloco.config.schema import MODEL_PRESETS, ModelConfig
from diloco.files import output_file
from diloco.engine.throughput import sheet_peak as peak_of
from diloco.model.transformer import flops_per_token
from outer_optim.compression import AUTO_CODECS, exchange_factor, make_codec
from peers.wire.probe import LinkProbe, read_probe

RESULTS = Path(__file__).resolve().parent / "results"
GPU_RUN = "gpu-run-h100-placements/results.json"
"""A running island's rounds on a GPU (``benchmarks/gpu_run.py``), the outer state on the host."""
GPU_RUN_OUTER_ON_GPU = "gpu-run-h100-fingerprint-fix/results.json"
"""The same island's blocking rounds with the outer state on the GPU (``--diloco.master_device cuda``)."""

# Vendors' data sheets (no measurement of ours): memory (GB) and NVLink bandwidth one way (GB/s) per GPU.
DATA_SHEET: dict[str, tuple[float, float]] = {
    "h100": (80.0, 450.0), "h200": (141.0, 450.0), "a100": (80.0, 300.0), "b200": (180.0, 900.0),
}
PCIE_GB_S = 25.0
"""One way, PCIe 4.0 x16 (data sheet): tensor parallelism without NVLink."""
TCP_WINDOW_BYTES = 6 * 1024 * 1024
"""Linux's default largest receive window (``net.ipv4.tcp_rmem``): one stream moves at most this per RTT."""
BYTES_PER_PARAM = 16
"""fp32 weights, fp32 gradients and AdamW's two fp32 moments (the island's bf16 autocast keeps fp32 masters)."""
HOST_BYTES_PER_PARAM = 12
"""θ_global, the outer momentum and the pinned Δ, fp32, in the server's host memory."""
MEMORY_HEADROOM = 0.9
"""Share of a GPU's memory a plan may fill (the allocator's fragmentation, NCCL buffers)."""
H_CHOICES = (25, 50, 100, 250, 500, 1000)
CODEC_CHOICES = tuple(c for c in AUTO_CODECS if c != "int2")
"""The codecs the plan weighs: those whose loss it has a measurement of with AdamW inside the islands (``int2``
was measured under Muon only, ``experiments/results/muon-compare/muon-int2``)."""
OVERLAP_CHOICES = ("blocking", "delayed", "streaming")
STREAMING_FRAGMENTS = 4


# ---- inputs ----------------------------------------------------------------------------------------------

@dataclass
class Servers:
    """The machines: ``count`` servers (one island each) of ``gpus`` GPUs of one ``kind``."""

    count: int = 2
    gpus: int = 8
    kind: str = "h100"
    memory_gb: float = 0.0
    """Per GPU; 0: the data sheet's."""
    nvlink: bool = True
    host_memory_gb: float = 1000.0
    price_per_gpu_hour: float = 2.5


@dataclass
class Link:
    """Between two servers: the rate of ``streams`` TCP streams together, of one stream, and the round trip."""

    rate_bits: float
    rtt_s: float
    rate_1_bits: float = 0.0
    """One stream; 0: the lesser of ``rate_bits`` and a default window per round trip."""
    streams: int = 8
    loss: float | None = None
    source: str = "given"
    joiners_accept: bool = True
    """Whether the servers that join (those that ran ``diloco probe --initial-peers``) accept connections: False
    puts them in ``--averaging.client_mode``."""

    def rate(self, streams: int) -> float:
        """Bits/s of ``streams`` TCP streams together."""
        one = self.rate_1_bits or min(self.rate_bits, 8 * TCP_WINDOW_BYTES / max(self.rtt_s, 1e-4))
        if streams <= 1:
            return one
        # between one stream and the measured `streams` streams, the rate grows with the count
        many = self.rate_bits if self.rate_1_bits else min(self.rate_bits, streams * one)
        return min(many, one + (many - one) * (streams - 1) / max(self.streams - 1, 1))

    @classmethod
    def from_probe(cls, p: LinkProbe, source: str) -> "Link":
        return cls(rate_bits=p.rate_n_mbit * 1e6, rtt_s=p.rtt_ms / 1e3, rate_1_bits=p.rate_1_mbit * 1e6,
                   streams=p.streams, loss=p.loss, source=source, joiners_accept=p.caller_accepts)


@dataclass
class Model:
    """Dimensions of a Llama-style model (as :mod:`diloco.model.transformer` builds it)."""

    name: str
    dim: int
    layers: int
    heads: int
    ffn: int
    seq: int
    vocab: int

    @classmethod
    def of_preset(cls, name: str, vocab: int) -> "Model":
        """The dimensions of preset ``name`` (one of :data:`MODEL_PRESETS`) with a vocabulary of ``vocab``."""
        p = MODEL_PRESETS[name]
        return cls(name, p["dim"], p["n_layers"], p["n_heads"], p["ffn_dim"], p["seq_len"], vocab)

    @property
    def params(self) -> int:
        return self.layers * (4 * self.dim ** 2 + 3 * self.dim * self.ffn + 2 * self.dim) + self.dim \
            + 2 * self.dim * self.vocab

    @property
    def flops_per_token(self) -> float:
        """:func:`diloco.model.transformer.flops_per_token` of these dimensions."""
        return flops_per_token(ModelConfig(preset="", dim=self.dim, n_layers=self.layers, n_heads=self.heads,
                                           ffn_dim=self.ffn, seq_len=self.seq, vocab_size=self.vocab))

    def flags(self) -> str:
        preset = MODEL_PRESETS.get(self.name)
        if preset is not None and preset == dict(dim=self.dim, n_layers=self.layers, n_heads=self.heads,
                                                 ffn_dim=self.ffn, seq_len=self.seq):
            return f"--model.preset {self.name}"
        return (f"--model.dim {self.dim} --model.n_layers {self.layers} --model.n_heads {self.heads} "
                f"--model.ffn_dim {self.ffn} --model.seq_len {self.seq}")


@dataclass
class Inputs:
    """Everything :func:`make_plan` plans from, and which of it was assumed rather than given."""

    model: Model
    servers: Servers
    link: Link
    tokens: float
    batch_tokens: int
    """Tokens of one island's inner step (DiLoCo's 512 × 1024 by default)."""
    max_loss_penalty: float
    """Relative loss above synchronous training a candidate may predict (0.01: 1%)."""
    compute_file: Path | None = None
    """A ``benchmarks/gpu_island.py``-format results.json measured on the device to plan for."""
    assumed: list[str] = field(default_factory=list)


# ---- constants read from measurements ---------------------------------------------------------------------

@dataclass
class Sources:
    """Every constant the plan uses, with the file it came from."""

    results: Path = RESULTS
    used: dict[str, str] = field(default_factory=dict)

    def note(self, what: str, where: str) -> None:
        self.used[what] = where

    def _read(self, rel: str) -> Any:
        path = self.results / rel
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            raise PlanError(f"{path} is missing or unreadable; it holds figures `diloco plan` needs (restore it "
                            f"from the repository)") from None

    def _jsonl(self, path: Path, writer: str = "benchmarks/gpu_island.py") -> list[dict[str, Any]]:
        try:
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            raise PlanError(f"{path} is missing or is not a results.json of {writer}") from None

    def device_rows(self, kind: str, compute_file: Path | None) -> tuple[list[dict[str, Any]], str, str]:
        """The single-device rows measured for ``kind`` (or read from ``compute_file``), the device's name and
        the file; for a kind never measured, the H100's rows (their MFU is applied to the kind's data sheet)."""
        files = [compute_file] if compute_file else sorted(self.results.glob("gpu-island*/results.json"))
        found: list[tuple[str, list[dict[str, Any]], Path]] = []
        for f in files:
            records = self._jsonl(f)
            card = next((r for r in records if r.get("section") == "card"), {})
            rows = [r for r in records if r.get("section") == "inner"]
            found.append((str(card.get("device", "")), rows, f))
        for device, rows, f in found:
            if compute_file or kind.lower() in device.lower():
                return rows, device, self._rel(f)
        for device, rows, f in found:
            if "h100" in device.lower():
                return rows, device, self._rel(f)
        raise PlanError(f"no measured GPU rows under {self.results}/gpu-island*; give --compute FILE")

    def _rel(self, path: Path) -> str:
        try:
            return str(path.resolve().relative_to(self.results.parent.parent))
        except ValueError:
            return str(path)

    def round_overhead(self) -> tuple[float, float]:
        """(seconds a round takes beyond its bytes at no latency, round trips it adds), from the latency runs."""
        rows = self._read("latency/results.json")
        zero = next(r for r in rows if r["rtt_ms"] == 0)
        fixed = max(0.0, zero["round_seconds_median"] - zero["bytes_seconds"])
        trips = [r["round_trips_added"] for r in rows if r["rtt_ms"] > 0]
        self.note("round: fixed seconds and round trips", "experiments/results/latency/results.json")
        return fixed, sum(trips) / len(trips)

    def handover_seconds_per_param(self) -> float:
        """The training thread's hold per round and parameter with the round in flight (CPU, own thread)."""
        rows = self._read("round-stall/results.json")
        row = next(r for r in rows if r["overlap"] == "delayed" and r["round_thread"])
        stall = sum(i["stall_median_s"] for i in row["islands"]) / len(row["islands"])
        self.note("hand-over of a round in flight", "experiments/results/round-stall/results.json (40m, CPU)")
        return stall / 40e6

    def _gpu_island(self, rel: str, case: str) -> dict[str, Any] | None:
        """The first island's figures of ``case`` in the ``benchmarks/gpu_run.py`` results at ``rel`` (None when
        the file, the case or its island is missing)."""
        path = self.results / rel
        if not path.exists():
            return None
        row = {r["case"]: r for r in self._jsonl(path, "benchmarks/gpu_run.py")}.get(case)
        return row["islands"][0] if row and row["islands"] else None

    def gpu_round_seconds_per_param(self) -> tuple[float, float] | None:
        """(the training thread's hold with the round on its own thread, the round's whole host work) per round
        and parameter, measured in a running 1b island on a GPU (``benchmarks/gpu_run.py``: the median stall of
        its delayed and of its blocking rounds); None when that run is missing."""
        islands = [self._gpu_island(GPU_RUN, c) for c in ("1b-delayed", "1b-blocking")]
        if not all(i and "stall_median_s" in i for i in islands):
            return None
        delayed, blocking = (i["stall_median_s"] for i in islands)
        params = Model.of_preset("1b", 256).params
        self.note("hand-over of a round in flight, and the round's host work", f"experiments/results/{GPU_RUN} (1b "
                  f"in its running loop on one H100: {delayed:.3f} s and {blocking:.2f} s a round; the host's "
                  f"work, taken as is for every GPU kind)")
        return delayed / params, blocking / params

    def gpu_outer_state(self) -> tuple[float, float] | None:
        """(a blocking round's stall per parameter with the outer state on the GPU, the GPU bytes per parameter
        that placement adds): a running 1b island's blocking rounds with ``--diloco.master_device cuda`` against
        the same rounds with the outer state on the host; None when either run is missing."""
        host = self._gpu_island(GPU_RUN, "1b-blocking")
        gpu = self._gpu_island(GPU_RUN_OUTER_ON_GPU, "1b-blocking-outer-on-gpu")
        if not (host and gpu):
            return None
        params = Model.of_preset("1b", 256).params
        stall = gpu["stall_median_s"]
        extra = (gpu["peak_memory_gb"] - host["peak_memory_gb"]) * 1e9 / params
        self.note("the outer state on the GPU (blocking rounds)", f"experiments/results/{GPU_RUN_OUTER_ON_GPU} "
                  f"against {GPU_RUN} (1b on one H100: {stall:.3f} s a round, +{extra:.1f} bytes of GPU memory "
                  f"per parameter)")
        return stall / params, extra

    def host_seconds_per_param(self, device_file: str) -> dict[str, float]:
        """Outer-state work per parameter: Δ to the host, the Nesterov step, θ back (the gpu-island table)."""
        path = self.results.parent.parent / device_file
        records = self._jsonl(path) if path.exists() else []
        rows = [r for r in records if r.get("section") == "outer"]
        if not rows:
            rows = [r for r in self._jsonl(self.results / "gpu-island/results.json") if r.get("section") == "outer"]
            device_file = "experiments/results/gpu-island/results.json"
        self.note("outer state on the host", device_file)
        out = {}
        for r in rows:
            n = float(r["params"])
            what = str(r["row"])
            key = "to_host" if "pinned" in what and "to host" in what else "step" if "Nesterov" in what else \
                "to_device" if "to the GPU" in what else ""
            if key:
                out[key] = float(r["seconds"]) / n
        return out

    def wire_ratios(self) -> dict[str, float]:
        """Bytes on the wire ÷ the codec's bytes of each entropy-coded codec, from a compare run that used them."""
        data = self._read("compare-entropy/results.json")
        c = data["config"]
        m, k, rounds = c["model"], int(data["islands"]), int(c["diloco"]["outer_steps"])
        params = Model.of_preset(m["preset"], m["vocab_size"]).params
        out = {}
        for run in data["runs"]:
            name = str(run["name"]).removeprefix("diloco-codec-")
            if name != run["name"] and name in CODEC_CHOICES and make_codec(name).skewed:
                codec = make_codec(name)
                out[name] = float(run["bytes_per_worker"]) / (rounds * exchange_factor(codec, k) * codec.nbytes(params))
        self.note("entropy coding on the wire: " + ", ".join(f"{n} × {r:.3f}" for n, r in out.items()),
                  "experiments/results/compare-entropy/results.json (bytes sent ÷ the codec's bytes)")
        return out

    def loss_gaps(self) -> dict[str, Any]:
        return self._read("published/loss-gaps.json")

    def horizon_gap(self, rel: str, arms: tuple[str, ...]) -> tuple[float, float]:
        """(mean, half spread) of the last round's gap of ``arms`` to blocking fp32 DiLoCo in a horizon run."""
        data = self._read(rel)
        curves = data["loss_per_round"]
        base = curves["blocking"][-1]
        gaps = [curves[a][-1] / base - 1 for a in arms if a in curves]
        self.note(f"loss of {', '.join(arms)} vs blocking DiLoCo", f"experiments/results/{rel} "
                  f"({data['islands']} islands, H={data['H']}, {data['rounds']} rounds)")
        return sum(gaps) / len(gaps), (max(gaps) - min(gaps)) / 2


class PlanError(RuntimeError):
    """A plan cannot be made (a figure it needs is missing): the message says which file."""


# ---- compute of one island -----------------------------------------------------------------------------

@dataclass
class Shape:
    """How one island spreads over its server's GPUs."""

    dp: int
    tp: int
    pp: int
    micro: int
    """Sequences per micro-batch of one dp replica (``--inner.batch_size``; split over pp micro-batches)."""
    accum: int
    checkpointing: bool
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    memory_gb: float = 0.0
    why_not: str = ""

    def flags(self) -> str:
        out = f"--parallel.dp {self.dp} --parallel.tp {self.tp} --parallel.pp {self.pp}"
        if self.pp > 1:
            out += f" --parallel.schedule 1f1b --parallel.microbatches {self.microbatches}"
        if self.checkpointing:
            out += " --parallel.activation_checkpointing true"
        return out + f" --inner.batch_size {self.micro} --inner.grad_accum {self.accum}"

    @property
    def microbatches(self) -> int:
        return min(self.micro, 4 * self.pp) if self.pp > 1 else 1

    def label(self) -> str:
        return f"dp{self.dp}·tp{self.tp}·pp{self.pp}, {self.micro}×{self.accum}{', ckpt' if self.checkpointing else ''}"


@dataclass
class Device:
    """What one GPU (or CPU) of the plan delivers, from a measured row."""

    name: str
    achieved_flops: float
    """FLOP/s of one device on the model, at the measured MFU."""
    mfu: float | None
    memory_gb: float
    nvlink_bytes: float
    act_bytes: float
    """Activation bytes per token, layer and model dimension, fitted to the measured peak memory."""
    source: str
    note: str


def device_for(inputs: Inputs, sources: Sources) -> Device:
    """The plan's device: the measured row nearest the model in size, at the kind's peak."""
    kind = inputs.servers.kind.lower()
    rows, measured_on, source = sources.device_rows(kind, inputs.compute_file)
    if not rows:
        raise PlanError(f"{source} holds no inner-step rows")
    best = [r for r in rows if "compile" in str(r.get("row", ""))] or rows
    model = inputs.model
    row = min(best, key=lambda r: abs(math.log(float(r["params"]) / model.params)))
    row_model = _row_model(row, model)
    row_flops = float(row["tokens_per_s"]) * row_model.flops_per_token
    sheet_peak = peak_of(kind) or 0.0
    measured_peak = peak_of(measured_on) or 0.0
    note = f"{row['row']} of {row['preset']} on one {measured_on or kind}"
    if sheet_peak and measured_peak and kind not in measured_on.lower():
        row_flops *= sheet_peak / measured_peak
        note += f", scaled to the {kind.upper()} data sheet's peak (no measurement on a {kind.upper()})"
    mfu = row_flops / sheet_peak if sheet_peak else None
    memory, nvlink = DATA_SHEET.get(kind, (0.0, 0.0))
    if inputs.servers.memory_gb:
        memory = inputs.servers.memory_gb
    if not inputs.servers.nvlink:
        nvlink = PCIE_GB_S
    tokens = _batch_tokens(str(row["batch"]))
    act = (float(row.get("peak_memory_gb", 0)) * 1e9 - BYTES_PER_PARAM * float(row["params"])) \
        / (tokens * row_model.layers * row_model.dim)
    sources.note("compute of one device", f"{source}: {note}")
    return Device(name=kind, achieved_flops=row_flops, mfu=mfu, memory_gb=memory, nvlink_bytes=nvlink * 1e9,
                  act_bytes=max(act, 2.0), source=source, note=note)


def _row_model(row: dict[str, Any], model: Model) -> Model:
    """The model a measured row ran: its preset, with the vocabulary its parameter count implies (``model``'s
    dimensions with byte tokens for a row of no preset)."""
    name = str(row["preset"])
    if name not in MODEL_PRESETS:
        return replace(model, vocab=256)
    body = Model.of_preset(name, 0)  # every parameter but the embedding and the output head
    return Model.of_preset(name, max(1, round((float(row["params"]) - body.params) / (2 * body.dim))))


def _batch_tokens(batch: str) -> int:
    rows, _, seq = batch.partition("x")
    return int(rows) * int(seq)


def island_shapes(inputs: Inputs, device: Device) -> list[Shape]:
    """Every dp × tp × pp shape of one server, with the best micro-batch that fits, fastest first; those that fit
    nowhere carry ``why_not``."""
    m, g = inputs.model, inputs.servers.gpus
    seqs = max(1, inputs.batch_tokens // m.seq)
    shapes = []
    for tp in _divisors(g):
        if tp > 1 and (m.heads % tp or m.ffn % tp):
            continue
        for pp in _divisors(g // tp):
            if pp > m.layers:
                continue
            dp = g // (tp * pp)
            if seqs % dp:
                continue
            per_replica = seqs // dp
            fits = [s for ckpt in (False, True)
                    for micro in _divisors(per_replica) if micro >= (pp if pp > 1 else 1)
                    for s in [_shape_cost(inputs, device, Shape(dp, tp, pp, micro, per_replica // micro, ckpt))]]
            ok = [s for s in fits if not s.why_not]
            # the measured MFU is that of a full micro-batch: of equal predictions, the largest micro-batch
            best = max(ok, key=lambda s: (round(s.tokens_per_s, -2), not s.checkpointing, s.micro)) if ok else None
            shapes.append(best or min(fits, key=lambda s: s.memory_gb))
    return sorted(shapes, key=lambda s: (bool(s.why_not), -s.tokens_per_s))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shape_cost(inputs: Inputs, device: Device, s: Shape) -> Shape:
    m, g = inputs.model, inputs.servers.gpus
    tokens = s.dp * s.micro * s.accum * m.seq
    flops = tokens * m.flops_per_token * (4 / 3 if s.checkpointing else 1)  # recompute: one more forward
    compute = flops / (g * device.achieved_flops)
    if s.pp > 1:  # 1F1B's bubble
        compute /= 1 - (s.pp - 1) / (s.microbatches + s.pp - 1)
    if s.tp > 1:  # four all-reduces of the activations per layer (two forward, two backward), not overlapped
        per_micro = s.micro * m.seq * m.dim * 2 * 4 * (m.layers / s.pp) * 2 * (s.tp - 1) / s.tp
        compute += per_micro * s.accum / device.nvlink_bytes
    if s.dp > 1:  # FSDP: gathers per micro-batch (bf16), one fp32 reduce-scatter per step, under the compute
        shard = m.params / (s.tp * s.pp)
        fsdp = (4 * shard * s.accum + 4 * shard) * (s.dp - 1) / s.dp / device.nvlink_bytes
        compute = max(compute, fsdp)
    static = BYTES_PER_PARAM * m.params / g
    micro_tokens = s.micro * m.seq / (s.microbatches if s.pp > 1 else 1)
    layers = m.layers / s.pp
    in_flight = min(s.pp, s.microbatches) if s.pp > 1 else 1
    if s.checkpointing:
        act = micro_tokens * m.dim * (4 * layers + device.act_bytes / s.tp) * in_flight
    else:
        act = micro_tokens * m.dim * layers * device.act_bytes / s.tp * in_flight
    s.memory_gb = (static + act) / 1e9
    s.step_s = compute
    s.tokens_per_s = tokens / compute
    s.mfu = s.tokens_per_s * m.flops_per_token / g / (device.achieved_flops / device.mfu) if device.mfu else 0.0
    if device.memory_gb and s.memory_gb > MEMORY_HEADROOM * device.memory_gb:
        s.why_not = (f"needs {s.memory_gb:.0f} GB per GPU, more than {MEMORY_HEADROOM:.0%} of the "
                     f"{device.memory_gb:.0f} GB of a {device.name.upper()}")
    return s


# ---- rounds and the whole run ----------------------------------------------------------------------------

@dataclass
class Candidate:
    """One way to run: an island shape and how its rounds go, with what the plan predicts of it."""

    name: str
    shape: Shape
    H: int = 0
    codec: str = "none"
    overlap: str = "blocking"
    sync: bool = False
    """The synchronous alternative (HSDP across the servers) rather than DiLoCo."""
    outer_on_gpu: bool = False
    """θ_global and the outer momentum on the GPUs (``--diloco.master_device cuda``) rather than the host."""
    bytes_per_round: float = 0.0
    round_s: float = 0.0
    utilization: float = 0.0
    tokens_per_s: float = 0.0
    """Of one island while it trains (the whole run's is ``servers × this × utilization``)."""
    wall_s: float = 0.0
    cost: float = 0.0
    loss_penalty: float = 0.0
    loss_uncertainty: float = 0.0

    @property
    def fragments(self) -> int:
        return STREAMING_FRAGMENTS if self.overlap == "streaming" else 1


@dataclass
class RoundModel:
    """The figures a round's time is predicted from."""

    fixed_s: float
    round_trips: float
    host_s_per_param: float
    handover_s_per_param: float
    wire_ratio: dict[str, float] = field(default_factory=dict)
    gpu_s_per_param: float | None = None
    """A blocking round's work with the outer state on the GPU (None: not measured, or a plan for CPUs)."""
    gpu_bytes_per_param: float = 0.0
    """The GPU memory that placement adds per parameter (over the island's GPUs)."""
    gpu_memory_gb: float = 0.0
    """One GPU's memory (0: not checked)."""
    """Bytes on the wire ÷ the codec's bytes, for the codecs entropy coding shrinks (``--averaging.entropy_coding``,
    on by default)."""


@dataclass
class LossModel:
    """The loss penalty of DiLoCo against synchronous training, as sums of measured or published gaps."""

    base: list[tuple[float, float]]
    """(parameters, gap of DiLoCo H=30 at 2 islands) from the published table."""
    per_doubling_h: tuple[float, float]
    """(cost of doubling H, half the spread of the sources), not shrinking with size: the published H=100 vs H=30
    gap is as large at 1B as at 35M."""
    per_doubling_k: float
    codec: dict[str, tuple[float, float]]
    overlap: dict[str, tuple[float, float]]

    def predict(self, params: float, H: int, islands: int, codec: str, overlap: str) -> tuple[float, float]:
        """(relative penalty, uncertainty)."""
        xs = [math.log(p) for p, _ in self.base]
        x = min(max(math.log(params), xs[0]), xs[-1])
        i = max(j for j in range(len(xs)) if xs[j] <= x) if x < xs[-1] else len(xs) - 2
        w = (x - xs[i]) / (xs[i + 1] - xs[i])
        base = self.base[i][1] * (1 - w) + self.base[i + 1][1] * w
        size = base / self.base[0][1] if self.base[0][1] else 1.0  # the H and islands terms shrink with size too
        h = self.per_doubling_h[0] * math.log2(H / 30)
        k = self.per_doubling_k * math.log2(max(islands, 2) / 2) * size
        if codec not in self.codec:
            raise PlanError(f"the plan has no measured loss for --averaging.compression {codec}; it weighs "
                            f"{', '.join(self.codec)}")
        c, c_err = self.codec[codec]
        o, o_err = self.overlap.get(overlap, (0.0, 0.0))
        total = max(0.0, base + h + k + c + o)
        h_err = self.per_doubling_h[1] * abs(math.log2(H / 30))
        return total, 0.003 + 0.5 * (base + k) + h_err + c_err + o_err


def loss_model(sources: Sources) -> LossModel:
    """Read the published gaps and our measured codec and overlap gaps."""
    gaps = sources.loss_gaps()
    s = gaps["streaming_diloco_m2_h30"]
    base = [(p, d / dp - 1) for p, d, dp in zip(s["params"], s["diloco_h30"], s["data_parallel"])]
    sources.note("DiLoCo's gap by size (H=30, 2 islands)", "experiments/results/published/loss-gaps.json: "
                 + s["source"])
    h = gaps["diloco_h_sweep"]
    loss = math.log(h["perplexity_at_h500"])
    per_h = [math.log1p(h["perplexity_increase"]) / loss / math.log2(h["h_high"] / h["h_low"])]
    per_h += [(a / b - 1) / math.log2(100 / 30) for a, b in zip(s["streaming_fp4_h100"], s["streaming_fp4_h30"])]
    sources.note("H's cost per doubling", "experiments/results/published/loss-gaps.json: " + h["source"]
                 + "; and Streaming DiLoCo's FP4 H=100 vs H=30 at 35M-1B")
    m4 = gaps["streaming_diloco_m4"]
    per_k = (m4["extra_loss_low"] + m4["extra_loss_high"]) / 2 / m4["loss_m2"][0]
    sources.note("islands' cost per doubling", "experiments/results/published/loss-gaps.json: " + m4["source"])
    int4 = sources.horizon_gap("horizon-12/results.json", ("int4",))
    codec = {"none": (0.0, 0.0), "fp16": (0.0, abs(int4[0]) + 0.001), "int8": (0.0, abs(int4[0]) + 0.001),
             "int4": (max(int4[0], 0.0), int4[1] + 0.001),
             "sign": sources.horizon_gap("horizon-12-sign/results.json", ("sign",))}
    delayed = sources.horizon_gap("horizon-12/results.json", ("delayed", "delayed, 2nd run"))
    fp4 = [(a / b - 1) for a, b in zip(s["streaming_fp4_h30"], s["diloco_h30"])]
    streaming = (sum(fp4) / len(fp4), max(abs(x) for x in fp4))
    sources.note("streaming fragments vs DiLoCo", "experiments/results/published/loss-gaps.json (streaming FP4 "
                 "H=30 vs DiLoCo H=30)")
    h_cost = (sum(per_h) / len(per_h), (max(per_h) - min(per_h)) / 2)
    return LossModel(base, h_cost, per_k, codec, {"blocking": (0.0, 0.0), "delayed": delayed,
                                                 "streaming": streaming})


def round_model(sources: Sources, device: Device) -> RoundModel:
    """A round's fixed costs, its host work and the training thread's hold: measured in a running island on a
    GPU when the plan is for GPUs and that run exists, else pieced together (the outer state's copies and step
    from the device's benchmark, the hand-over from CPU islands)."""
    fixed, trips = sources.round_overhead()
    measured = sources.gpu_round_seconds_per_param() if device.name != "cpu" else None
    if measured is not None:
        handover, host = measured
    else:
        host = sum(sources.host_seconds_per_param(device.source).values())
        handover = sources.handover_seconds_per_param()
    on_gpu = sources.gpu_outer_state() if device.name != "cpu" else None
    return RoundModel(fixed, trips, host, handover, sources.wire_ratios(), *(on_gpu or (None, 0.0)),
                      gpu_memory_gb=device.memory_gb)


def codec_bytes_per_value(codec: str) -> float:
    numel = 1 << 20
    return make_codec(codec).nbytes(numel) / numel


def outer_state_on_gpu(inputs: Inputs, shape: Shape, rounds: RoundModel, overlap: str) -> bool:
    """Whether the outer state goes on the GPUs (``--diloco.master_device cuda``): for blocking rounds, whose
    every second of outer work the GPUs wait for, when it was measured and fits next to the shape's memory.
    Rounds in flight keep it on the host, where their work hides behind the inner steps and leaves the GPU's
    memory to activations."""
    if overlap != "blocking" or rounds.gpu_s_per_param is None:
        return False
    extra = rounds.gpu_bytes_per_param * inputs.model.params / inputs.servers.gpus / 1e9
    return not rounds.gpu_memory_gb or shape.memory_gb + extra <= MEMORY_HEADROOM * rounds.gpu_memory_gb


def diloco_candidate(inputs: Inputs, shape: Shape, rounds: RoundModel, losses: LossModel, H: int, codec: str,
                     overlap: str, name: str = "", outer_on_gpu: bool | None = None) -> Candidate:
    """What a DiLoCo run of this shape, H, codec and overlap predicts; the outer state's place is
    :func:`outer_state_on_gpu`'s unless ``outer_on_gpu`` says."""
    m, k = inputs.model, inputs.servers.count
    on_gpu = outer_state_on_gpu(inputs, shape, rounds, overlap) if outer_on_gpu is None else outer_on_gpu
    c = Candidate(name or f"H={H} {codec} {overlap}" + (", outer state on GPU" if on_gpu else ""), shape, H=H,
                  codec=codec, overlap=overlap, outer_on_gpu=on_gpu)
    host = rounds.gpu_s_per_param if on_gpu and rounds.gpu_s_per_param is not None else rounds.host_s_per_param
    per_round = codec_bytes_per_value(codec) * m.params / c.fragments * rounds.wire_ratio.get(codec, 1.0)
    c.bytes_per_round = per_round * exchange_factor(make_codec(codec), k)
    streams = inputs.servers.gpus  # each rank sends its own part of Δ
    c.round_s = rounds.fixed_s + rounds.round_trips * inputs.link.rtt_s + 8 * c.bytes_per_round \
        / inputs.link.rate(streams) + host * m.params / c.fragments
    steps = H / c.fragments  # between two syncs
    compute = steps * shape.step_s
    if overlap == "blocking":
        wall = compute + c.round_s
    else:
        wall = compute + rounds.handover_s_per_param * m.params / c.fragments + max(0.0, c.round_s - compute)
    c.utilization = compute / wall
    c.tokens_per_s = shape.tokens_per_s
    _run_totals(inputs, c)
    c.loss_penalty, c.loss_uncertainty = losses.predict(m.params, H, k, codec, overlap)
    return c


def sync_candidate(inputs: Inputs, shape: Shape, rounds: RoundModel) -> Candidate:
    """HSDP: FSDP inside each server, fp32 gradients all-reduced across the servers every step, overlapped with
    the backward pass (two thirds of the step)."""
    m, k = inputs.model, inputs.servers.count
    c = Candidate("HSDP (synchronous)", shape, H=1, overlap="every step", sync=True)
    c.bytes_per_round = 4 * m.params * 2 * (k - 1) / k
    c.round_s = (k - 1) * inputs.link.rtt_s + 8 * c.bytes_per_round / inputs.link.rate(inputs.servers.gpus)
    wall = shape.step_s + max(0.0, c.round_s - 2 / 3 * shape.step_s)
    c.utilization = shape.step_s / wall
    c.tokens_per_s = shape.tokens_per_s
    _run_totals(inputs, c)
    return c


def _run_totals(inputs: Inputs, c: Candidate) -> None:
    s = inputs.servers
    c.wall_s = inputs.tokens / (s.count * c.tokens_per_s * c.utilization)
    c.cost = c.wall_s / 3600 * s.count * s.gpus * s.price_per_gpu_hour


@dataclass
class Plan:
    inputs: Inputs
    device: Device
    shapes: list[Shape]
    best: list[Candidate]
    default: Candidate | None
    sync: Candidate | None
    within_budget: bool
    sources: dict[str, str]
    seconds: float = 0.0


def make_plan(inputs: Inputs, results: Path = RESULTS, top: int = 5,
              choices: dict[str, tuple] | None = None) -> Plan:
    """Every candidate's prediction; the ``top`` fastest within the loss budget, the default and HSDP."""
    t0 = time.perf_counter()
    choices = {"H": H_CHOICES, "codec": CODEC_CHOICES, "overlap": OVERLAP_CHOICES, **(choices or {})}
    sources, device, shapes = _island(inputs, results)
    fitting = [s for s in shapes if not s.why_not]
    host_need = HOST_BYTES_PER_PARAM * inputs.model.params / 1e9
    if host_need > inputs.servers.host_memory_gb:
        fitting = []
        shapes.append(replace(shapes[0], why_not=f"the outer state needs {host_need:.0f} GB of host memory, more "
                                                 f"than the {inputs.servers.host_memory_gb:.0f} GB given"))
    if not fitting:
        return Plan(inputs, device, shapes, [], None, None, False, sources.used, time.perf_counter() - t0)
    rounds = round_model(sources, device)
    losses = loss_model(sources)
    best_shape = fitting[0]
    candidates = [diloco_candidate(inputs, best_shape, rounds, losses, H, codec, overlap)
                  for H in choices["H"] for codec in choices["codec"] for overlap in choices["overlap"]
                  if overlap != "streaming" or H % STREAMING_FRAGMENTS == 0]
    within = [c for c in candidates if c.loss_penalty <= inputs.max_loss_penalty]
    pool = within or sorted(candidates, key=lambda c: c.loss_penalty)[:top]
    # fastest first; within 1% of wall-clock, the smaller loss penalty first
    pool.sort(key=lambda c: (math.floor(math.log(c.wall_s) / math.log(1.01)), c.loss_penalty))
    default_shape = next((s for s in fitting if s.tp == 1 and s.pp == 1), best_shape)
    default = diloco_candidate(inputs, default_shape, rounds, losses, 50, "none", "blocking",
                               name="default (H=50 none blocking)", outer_on_gpu=False)
    sync = sync_candidate(inputs, default_shape, rounds)
    return Plan(inputs, device, shapes, pool[:top], default, sync, bool(within), sources.used,
                time.perf_counter() - t0)


def _island(inputs: Inputs, results: Path) -> tuple[Sources, Device, list[Shape]]:
    sources = Sources(results)
    device = device_for(inputs, sources)
    return sources, device, island_shapes(inputs, device)


def predict(inputs: Inputs, H: int, codec: str, overlap: str, results: Path = RESULTS) -> Candidate:
    """The prediction for one given configuration on the fastest island shape that fits (what the check
    experiment runs); ``H = 0``: the synchronous alternative."""
    sources, device, shapes = _island(inputs, results)
    fitting = [s for s in shapes if not s.why_not]
    if not fitting:
        raise PlanError(f"no island shape fits: {shapes[0].why_not}")
    rounds = round_model(sources, device)
    if H == 0:
        return sync_candidate(inputs, fitting[0], rounds)
    return diloco_candidate(inputs, fitting[0], rounds, loss_model(sources), H, codec, overlap)


# ---- output -------------------------------------------------------------------------------------------------

def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds / 60:,.1f} min"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.3g}{unit}"
    return f"{n:,.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:.0f} B"


def command_lines(inputs: Inputs, c: Candidate) -> list[str]:
    """The command of every server for candidate ``c``."""
    m, s = inputs.model, inputs.servers
    island_tokens = c.shape.dp * c.shape.micro * c.shape.accum * m.seq
    rounds = max(1, math.ceil(inputs.tokens / (s.count * island_tokens * c.H)))
    launcher = f"torchrun --nproc-per-node {s.gpus} -m diloco.cli train" if s.gpus > 1 else "diloco train"
    compile_flag = " --parallel.compile true" if s.kind != "cpu" else ""
    flags = (f"{m.flags()} {c.shape.flags()}{compile_flag} --diloco.inner_steps {c.H} "
             f"--diloco.outer_steps {rounds} --averaging.compression {c.codec} "
             f"--diloco.overlap {'none' if c.overlap == 'blocking' else 'delayed'}"
             + (f" --diloco.fragments {c.fragments}" if c.fragments > 1 else "")
             + (" --diloco.master_device cuda" if c.outer_on_gpu else "")
             + f" --data.num_shards {s.count}")
    ports = "TCP ports 31337-31338 open to the other servers"  # the DHT's and the next, the transport's
    lines = [f"# server 0 ({ports})\n{launcher} {flags} --data.shard_index 0 --averaging.host_maddrs "
             f"/ip4/0.0.0.0/tcp/31337"]
    nat = "" if inputs.link.joiners_accept else " --averaging.client_mode true"
    why = (f"; {ports}" if inputs.link.joiners_accept
           else "; behind NAT by diloco probe: it opens every connection itself")
    for i in range(1, s.count):
        lines.append(f"# server {i} (ADDR: the multiaddr server 0 prints{why})\n{launcher} {flags} "
                     f"--data.shard_index {i} --averaging.host_maddrs /ip4/0.0.0.0/tcp/31337{nat} --initial-peers ADDR")
    return lines


def format_plan(plan: Plan) -> str:
    """The plan as a person reads it: inputs (assumed ones marked), the island's shape, the candidates side by
    side, the commands of the pick and every source."""
    i = plan.inputs
    s, link, m = i.servers, i.link, i.model
    out = [f"# diloco plan: {m.name} ({m.params / 1e6:,.0f}M parameters) on {s.count} × {s.gpus} {s.kind.upper()}",
           "",
           f"link: {link.rate_bits / 1e6:,.0f} Mbit/s ({link.rate(s.gpus) / 1e6:,.0f} Mbit/s over {s.gpus} streams, "
           f"{link.rate(1) / 1e6:,.0f} over one), RTT {link.rtt_s * 1e3:g} ms ({link.source}); budget "
           f"{_count(i.tokens)} tokens, {i.batch_tokens:,} tokens per island step, "
           f"${s.price_per_gpu_hour:g} per GPU-hour, loss penalty ≤ {i.max_loss_penalty:.1%}"]
    if i.assumed:
        out.append("assumed (not given): " + "; ".join(i.assumed))
    out += ["", "## The island's shape", "",
            "| shape | step | tokens/s per island | MFU | memory per GPU | fits |", "|---|---|---|---|---|---|"]
    for sh in plan.shapes[:6]:
        mfu = f"{sh.mfu:.1%}" if plan.device.mfu else "n/a (no peak)"
        memory = f"{sh.memory_gb:,.1f} GB" if plan.device.memory_gb else "not checked"
        out.append(f"| {sh.label()} | {sh.step_s * 1e3:,.0f} ms | {sh.tokens_per_s:,.0f} | {mfu} | {memory} | "
                   f"{'yes' if not sh.why_not else sh.why_not} |")
    if not plan.best:
        out += ["", "no configuration fits: " + "; ".join(sorted({sh.why_not for sh in plan.shapes}))]
        return "\n".join(out)
    if not plan.within_budget:
        out += ["", f"no candidate is predicted within the {i.max_loss_penalty:.1%} loss penalty; the closest are "
                    f"shown (raise --max-loss-penalty, or use fewer islands or a smaller H)"]
    out += ["", "## Candidates (fastest first), the default and the synchronous alternative", "",
            "| run | bytes per sync | round | compute util. | tokens/s per island | wall-clock | cost | "
            "loss vs sync |", "|---|---|---|---|---|---|---|---|"]
    for c in plan.best + [plan.default, plan.sync]:
        penalty = "0 (reference)" if c.sync else f"+{c.loss_penalty:.2%} ± {c.loss_uncertainty:.2%}"
        sync = f" ({c.fragments} fragments)" if c.fragments > 1 else ""
        out.append(f"| {c.name} | {_bytes(c.bytes_per_round)}{sync} | {c.round_s:,.2f} s | {c.utilization:.1%} | "
                   f"{c.tokens_per_s:,.0f} | {_hours(c.wall_s)} | ${c.cost:,.0f} | {penalty} |")
    pick = plan.best[0]
    out += ["", f"pick: {pick.name} on {pick.shape.label()}: {_hours(pick.wall_s)} and ${pick.cost:,.0f} against "
                f"the default's {_hours(plan.default.wall_s)} and HSDP's {_hours(plan.sync.wall_s)}", "", "```bash"]
    out += command_lines(i, pick) + ["```", "", "## Where each figure comes from", ""]
    out += [f"- {what}: {where}" for what, where in plan.sources.items()]
    out += ["- memory per GPU, NVLink bandwidth, peaks: the vendors' data sheets (no multi-GPU measurement yet)",
            "- the HSDP row: the same step, fp32 gradients all-reduced across servers each step, overlapped with "
            "the backward pass", "", f"planned in {plan.seconds:.2f} s"]
    return "\n".join(out)


# ---- command line ---------------------------------------------------------------------------------------------

def parse_count(text: str, what: str) -> float:
    """``20B``, ``500M``, ``2e9`` → a number."""
    units = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    t = text.strip().lower()
    try:
        return float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise ConfigError([f"{what} must be a number such as 20B, 500M or 2e9, got {text!r}"]) from None


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    """Check the command line and fill what it leaves out (noted in ``assumed``)."""
    from experiments.netns import parse_rate

    problems, assumed = [], []
    if args.dims:
        try:
            dim, layers, heads, ffn, seq = (int(x) for x in args.dims.split(","))
            if min(dim, layers, heads, ffn, seq) < 1 or dim % heads:
                raise ValueError
            model = Model("custom", dim, layers, heads, ffn, seq, args.vocab_size)
        except ValueError:
            problems.append(f"--dims must be DIM,LAYERS,HEADS,FFN,SEQ (positive, DIM divisible by HEADS), such as "
                            f"4096,32,32,14336,8192, got {args.dims!r}")
            args.dims = ""
    if args.model_config is not None:
        if args.dims or args.model:
            problems.append("give the model once: --model.preset and --model.* keys (as train takes them), or "
                            "--model / --dims, not both")
        m = args.model_config
        preset = m.preset if MODEL_PRESETS.get(m.preset) == dict(
            dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, ffn_dim=m.ffn_dim, seq_len=m.seq_len) else "custom"
        model = Model(preset, m.dim, m.n_layers, m.n_heads, m.ffn_dim, m.seq_len, m.vocab_size or args.vocab_size)
    elif not args.dims:
        name = args.model or "1b"
        if name not in MODEL_PRESETS:
            problems.append(f"--model {name} is not a preset; use one of {', '.join(MODEL_PRESETS)} "
                            f"(or --dims)")
        model = Model.of_preset(name if name in MODEL_PRESETS else "1b", args.vocab_size)
    kind = args.gpu.lower()
    if kind not in DATA_SHEET and kind != "cpu":
        problems.append(f"--gpu {args.gpu} is not a kind the plan knows; use one of {', '.join(DATA_SHEET)} "
                        f"(or cpu with --compute FILE)")
    if kind == "cpu" and not args.compute:
        problems.append("--gpu cpu needs --compute FILE: a results.json measured on that CPU")
    if args.servers < 1 or args.gpus < 1:
        problems.append(f"--servers and --gpus must be at least 1, got {args.servers} and {args.gpus}")
    link = None
    if args.probe:
        text = Path(args.probe).read_text() if Path(args.probe).is_file() else args.probe
        try:
            line = next(ln for ln in reversed(text.strip().splitlines()) if ln.startswith("{"))
            link = Link.from_probe(read_probe(line), f"measured by diloco probe: {args.probe[:60]}")
        except (StopIteration, ValueError):
            problems.append(f"--probe must be a line printed by `diloco probe` or a file holding one, got "
                            f"{args.probe[:60]!r}")
    else:
        try:
            rate = parse_rate(args.link or "1gbit")
        except ValueError as e:
            problems.append(f"--link: {e}")
            rate = 1e9
        if args.rtt is not None and args.rtt < 0:
            problems.append(f"--rtt must be 0 ms or more, got {args.rtt}")
        if args.link is None:
            assumed.append("link 1 Gbit/s")
        if args.rtt is None:
            assumed.append("RTT 50 ms")
        link = Link(rate, (50.0 if args.rtt is None else args.rtt) / 1e3, source="given" if args.link else "assumed")
    tokens = parse_count(args.tokens, "--tokens") if args.tokens else 20 * model.params
    if not args.tokens:
        assumed.append(f"{_count(tokens)} tokens (20 per parameter)")
    for given, text in ((args.servers_given, "2 servers"), (args.gpus_given, f"{args.gpus} GPUs per server"),
                        (args.gpu_given, f"{args.gpu.upper()} GPUs"), (args.price_given, f"${args.price:g}/GPU-hour")):
        if not given:
            assumed.append(text)
    if args.compute and not Path(args.compute).is_file():
        problems.append(f"--compute {args.compute} is not a file; give a results.json of benchmarks/gpu_island.py")
    if not 0 < args.max_loss_penalty < 100:
        problems.append(f"--max-loss-penalty is a percentage in (0, 100), got {args.max_loss_penalty}")
    if problems:
        raise ConfigError(problems)
    servers = Servers(args.servers, args.gpus, kind, args.gpu_memory, not args.no_nvlink, args.host_memory,
                      args.price)
    return Inputs(model, servers, link, tokens, args.batch_tokens, args.max_loss_penalty / 100,
                  Path(args.compute) if args.compute else None, assumed)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="diloco plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help=f"preset: {', '.join(MODEL_PRESETS)} (default 1b); the same as --model.preset")
    p.add_argument("--config", help="a config file, as train takes: the plan reads its [model] section")
    p.add_argument("--dims", default="", help="a model of other dimensions: DIM,LAYERS,HEADS,FFN,SEQ "
                   "(Llama 3 8B: 4096,32,32,14336,8192)")
    p.add_argument("--vocab-size", type=int, default=32000, help="tokenizer vocabulary (default 32000)")
    p.add_argument("--servers", type=int, default=2, help="servers, one island each (default 2)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per server (default 8)")
    p.add_argument("--gpu", default="h100", help=f"GPU kind: {', '.join(DATA_SHEET)}, or cpu (default h100)")
    p.add_argument("--gpu-memory", type=float, default=0.0, help="GB per GPU (default: the data sheet's)")
    p.add_argument("--no-nvlink", action="store_true", help="the GPUs talk over PCIe")
    p.add_argument("--host-memory", type=float, default=1000.0, help="GB of host memory per server (default 1000)")
    p.add_argument("--link", help="rate between servers, such as 1gbit or 200mbit (default 1gbit)")
    p.add_argument("--rtt", type=float, help="round trip between servers in ms (default 50)")
    p.add_argument("--probe", help="a line printed by `diloco probe` (or a file holding it): the link measured")
    p.add_argument("--tokens", help="token budget of the run, such as 20B (default 20 per parameter)")
    p.add_argument("--batch-tokens", type=int, default=524288, help="tokens per island step (default 512 × 1024)")
    p.add_argument("--price", type=float, default=2.5, help="dollars per GPU-hour (default 2.5)")
    p.add_argument("--max-loss-penalty", type=float, default=1.0,
                   help="largest predicted loss above synchronous training, in percent (default 1)")
    p.add_argument("--compute", help="results.json of benchmarks/gpu_island.py measured on the device to plan for")
    p.add_argument("--top", type=int, default=5, help="candidates to show (default 5)")
    p.add_argument("--json", help="also write the plan as JSON to this file")
    p.set_defaults(model_config=None)  # the model section of --config and --model.* keys, once read
    return p


def main(argv: list[str] | None = None) -> int:
    """``diloco plan [options]``: print the plan."""
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parser().parse_known_args(argv)
    given = {a.split("=")[0] for a in argv}
    args.servers_given, args.gpus_given = "--servers" in given, "--gpus" in given
    args.gpu_given, args.price_given = "--gpu" in given, "--price" in given

    def body() -> int:
        # the model as train takes it (--model.preset, --model.dim, ..., --config FILE); the rest is the plan's
        cfg = config_for("diloco plan", "picks the island shape, H, codec and overlap itself", args.config, rest,
                         used=("model",))
        given_model = args.config is not None or any(a.startswith("--model.") for a in rest)
        args.model_config = cfg.model if given_model else None
        inputs = inputs_from_args(args)
        try:
            plan = make_plan(inputs, top=args.top)
        except (KeyError, StopIteration, TypeError, ZeroDivisionError) as e:
            raise PlanError(f"a file under {RESULTS} lacks a figure the plan reads ({e!r}); restore "
                            f"experiments/results/ from the repository") from None
        print(format_plan(plan), flush=True)
        if args.json:
            with output_file(args.json) as tmp:
                tmp.write_text(json.dumps(plan_json(plan), indent=2) + "\n")
        return 0 if plan.best else 1

    return run_command(body, (PlanError,))


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan's predictions as data (what the check experiment compares with measurements)."""
    def cand(c: Candidate) -> dict[str, Any]:
        return {"name": c.name, "shape": c.shape.label(), "H": c.H, "codec": c.codec, "overlap": c.overlap,
                "bytes_per_round": c.bytes_per_round, "round_s": c.round_s, "utilization": c.utilization,
                "tokens_per_s": c.tokens_per_s, "step_s": c.shape.step_s, "wall_s": c.wall_s, "cost": c.cost,
                "loss_penalty": c.loss_penalty, "loss_uncertainty": c.loss_uncertainty}

    return {"best": [cand(c) for c in plan.best], "default": cand(plan.default) if plan.default else None,
            "sync": cand(plan.sync) if plan.sync else None, "sources": plan.sources}


if __name__ == "__main__":
    sys.exit(main())

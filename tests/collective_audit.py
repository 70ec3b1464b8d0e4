"""The collective audit: every multi-rank test's collectives checked against the rules NCCL has and gloo has not.

The suite runs its islands on CPU over gloo, which accepts host tensors, lets any thread use a group, matches
point-to-point messages by tag and raises when a collective times out.  NCCL does none of that.  The audit runs
inside each rank process (:func:`install`, from :mod:`tests.audited_rank`, which the launchers in
``tests/conftest.py`` put in front of every rank's program while ``DILOCO_COLLECTIVE_AUDIT`` names a folder).  It
wraps torch.distributed's collectives, point-to-point calls and functional collectives, and records for each
process group:

- its *production backend*: gloo where the code asked for gloo by name, NCCL wherever a CUDA island would use
  it (the default group, and every group or mesh made with the default backend);
- each collective's group, tensor devices, calling thread, and the group's timeout;
- each point-to-point operation in the order it was posted (peer, size, tag).

It reports, per rank, into that folder; :func:`check` (called by the launchers once the ranks have ended) fails
the test on

- a host tensor on a would-be NCCL group;
- two threads on one group (NCCL: one communicator, one thread);
- a group whose timeout is not the run's (the default group's);
- point-to-point operations between two ranks posted in orders that differ (gloo matches them by tag; NCCL by
  the order they were posted, tags ignored).

**Devices on a CPU run.**  An island on CPU computes on the host, so a host tensor there is the right one and a
tensor check would see nothing.  Code that picks a collective's device by asking the group
(:func:`peers.island.exchange.collective_device`) can be run against a stand-in accelerator instead:
``DILOCO_AUDIT_STAND_IN=lazy`` makes the audit answer that question as a CUDA island would (the group's production
backend, and torch's ``lazy`` device for the GPU: real values computed on the host, but not the CPU device, so a
host tensor left where a GPU tensor belongs shows).  The audit carries the stand-in's tensors over gloo through
the host.  A model's own collectives (FSDP, TP, PP) run on the CPU device and are checked for threads, timeouts
and point-to-point order only.

Left out: collectives issued from inside compiled code (dynamo traces them; none of the suite's multi-rank tests
compiles), and the ``torch.ops._c10d_functional`` ops DTensor calls without going through
``torch.distributed._functional_collectives``.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

ENV = "DILOCO_COLLECTIVE_AUDIT"
"""The folder each audited rank reports into (the audit is off without it)."""
STAND_IN_ENV = "DILOCO_AUDIT_STAND_IN"
"""``lazy``: collectives whose device the code picks from the group are placed as on a CUDA island, on torch's
lazy device (see the module doc)."""
DETAIL_ENV = "DILOCO_AUDIT_DETAIL"
"""``1``: the launchers also set ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` in the ranks (torch checks every collective's
order and shapes across ranks)."""

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather", "scatter",
               "all_to_all", "all_to_all_single", "all_reduce_coalesced", "send", "recv", "isend", "irecv")
DEVICE_BY_TORCH = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                   "barrier", "monitored_barrier")
"""Calls whose tensors torch places itself (on the group's device: a GPU for NCCL)."""
FUNCTIONAL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
              "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
              "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd", "all_to_all_single_autograd")
P2P_KIND = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
IN_PLACE = ("all_reduce", "broadcast")
"""Collectives whose stand-in tensors the audit carries through the host and back."""
NOT_THE_CALLER = {"collective_audit.py", "audited_rank.py", "threading.py", "runpy.py"}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _where() -> str:
    """The innermost frame of the caller's code (not torch's, not the audit's): where the collective was issued."""
    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if not (name.startswith(("<", torch_dir)) or os.path.basename(name) in NOT_THE_CALLER):
            return f"{os.path.relpath(name)}:{frame.lineno} ({frame.name})"
    return "?"


class _Carried:
    """A work whose stand-in tensors travelled through host copies: waiting also copies the results back."""

    def __init__(self, work: Any, back: list[tuple[torch.Tensor, torch.Tensor]], keep: torch.Tensor):
        self.work, self.back, self.keep = work, back, keep

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self.work.wait(*args, **kwargs) if self.work is not None else True
        for target, host in self.back:
            target.copy_(host)
        self.back = []
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Recorder:
    """What one rank process did with its process groups (see the module doc)."""

    def __init__(self, out_dir: str, stand_in: str = ""):
        self.out_dir, self.pid = Path(out_dir), os.getpid()
        self.stand_in = torch.device(stand_in) if stand_in else None
        self.explicit: dict[str, str] = {}
        """Production backend of the groups made with a backend named (gloo), by group name."""
        self.groups: dict[str, dict[str, Any]] = {}
        self.violations: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.p2p: dict[str, list[list[Any]]] = {}
        self.calls = 0
        self._depth = threading.local()
        self._lock = threading.Lock()
        self._originals: dict[tuple[Any, str], Any] = {}

    # --------------------------------------------------------------------------------- groups
    def production_backend(self, group: Any) -> str:
        """``nccl`` or ``gloo``: what the group would be on a CUDA island (``fake`` for a fake one)."""
        name = group.group_name
        if name in self.explicit:
            return self.explicit[name]
        return "fake" if "fake" in c10d.get_backend(group) else "nccl"

    def _group(self, group: Any) -> tuple[Any, dict[str, Any]]:
        group = c10d._get_default_group() if group is None else group
        name = group.group_name
        info = self.groups.get(name)
        if info is None:
            from pipeline.mesh import group_timeout

            timeout = group_timeout(group)
            run = group_timeout(None)
            info = self.groups[name] = {
                "backend": self.production_backend(group), "real": c10d.get_backend(group),
                "ranks": c10d.get_process_group_ranks(group), "timeout_s": timeout and timeout.total_seconds(),
                "threads": {}, "calls": 0, "inside": {}}
            if info["backend"] != "fake" and timeout is not None and run is not None and timeout != run:
                self._violate("timeout", name, f"group {name} (ranks {info['ranks']}, {info['backend']} in production) "
                              f"has a timeout of {timeout.total_seconds():g} s, the run's is {run.total_seconds():g} s")
        return group, info

    def _violate(self, rule: str, group: str, message: str) -> None:
        key = (rule, group, message)
        with self._lock:
            seen = self.violations.setdefault(key, {"rule": rule, "group": group, "message": message, "count": 0,
                                                   "where": _where()})
            seen["count"] += 1

    # ------------------------------------------------------------------------------ recording
    def record(self, name: str, group: Any, tensors: list[torch.Tensor], p2p: list[tuple[str, int, int, str, int]],
               torch_places: bool = False) -> dict[str, Any]:
        """One collective (or a batch of point-to-point operations) about to be issued on ``group``; returns
        what is known of the group (pass it to :meth:`_inside` to issue the call)."""
        group, info = self._group(group)
        thread = threading.current_thread()
        key = str(thread.ident)
        if key not in info["threads"]:
            info["threads"][key] = f"{thread.name} (first at {_where()})"
        with self._lock:
            self.calls += 1
            info["calls"] += 1
            threads = dict(info["threads"])
            others = [t for t in info["inside"] if t != key]
        # NCCL: one communicator, one thread; a gloo group may change hands, but two threads in it at once would
        # issue their collectives in an order the other ranks need not share
        if len(threads) > 1 and (info["backend"] == "nccl" or others):
            at_once = "" if info["backend"] == "nccl" else " at once"
            self._violate("threads", group.group_name,
                          f"group {group.group_name} (ranks {info['ranks']}, {info['backend']} in production) is used "
                          f"by {len(threads)} threads{at_once}: {'; '.join(sorted(threads.values()))}")
        if info["backend"] == "nccl" and self.stand_in is not None and not torch_places:
            for t in tensors:
                if t.device.type != self.stand_in.type:
                    self._violate("device", group.group_name,
                                  f"{name}: a {t.device.type} tensor on group {group.group_name} "
                                  f"(ranks {info['ranks']}), which NCCL would serve")
        for kind, peer, numel, dtype, tag in p2p:
            with self._lock:
                self.p2p.setdefault(f"{group.group_name}|{kind}|{peer}", []).append([numel, dtype, tag])
        return info

    # ------------------------------------------------------------------------------- wrapping
    def _wrap(self, module: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(module, name, None)
        if original is None or (module, name) in self._originals:
            return
        self._originals[(module, name)] = original
        wrapper = make(original)
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(module, name, wrapper)

    def _top(self) -> bool:
        """Whether this call is the caller's own, not one torch makes inside another collective."""
        return getattr(self._depth, "n", 0) == 0 and not torch.compiler.is_compiling()

    def _inside(self, fn: Callable[[], Any], info: dict[str, Any]) -> Any:
        """Issue a recorded call: the thread is inside the group meanwhile, and torch's own calls are not the
        caller's."""
        key = str(threading.get_ident())
        with self._lock:
            info["inside"][key] = info["inside"].get(key, 0) + 1
        self._depth.n = getattr(self._depth, "n", 0) + 1
        try:
            return fn()
        finally:
            self._depth.n -= 1
            with self._lock:
                info["inside"][key] -= 1
                if not info["inside"][key]:
                    del info["inside"][key]

    def _collective(self, name: str, original: Callable[..., Any], signature: inspect.Signature,
                    torch_places: bool) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._top():
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            values = bound.arguments
            group = values.get("group")
            tensors = [t for k, v in values.items() if k != "group" for t in _tensors(v)]
            p2p = []
            if name in P2P_KIND:
                group_for_peer, _ = self._group(group)
                peer = values.get("dst", values.get("src"))
                if peer is None:
                    local = values.get("group_dst", values.get("group_src"))
                    peer = c10d.get_global_rank(group_for_peer, local) if local is not None else -1
                t = tensors[0]
                p2p.append((P2P_KIND[name], int(peer), t.numel(), str(t.dtype), int(values.get("tag", 0) or 0)))
            info = self.record(name, group, tensors, p2p, torch_places)
            if self.stand_in is not None and any(t.device.type == self.stand_in.type for t in tensors):
                return self._inside(lambda: self._carry(name, original, bound), info)
            return self._inside(lambda: original(*args, **kwargs), info)
        return wrapper

    def _carry(self, name: str, original: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        """Run a collective on stand-in tensors through host copies (gloo takes host tensors only)."""
        first = next(iter(bound.arguments))
        t = bound.arguments[first]
        if name not in IN_PLACE + tuple(P2P_KIND) or not isinstance(t, torch.Tensor):
            raise RuntimeError(f"the collective audit cannot carry {name} on the {self.stand_in} stand-in device")
        host = t.detach().to("cpu").clone()
        bound.arguments[first] = host
        work = original(*bound.args, **bound.kwargs)
        receives = P2P_KIND.get(name) == "recv" or name in IN_PLACE
        if not (name in ("isend", "irecv") or bound.arguments.get("async_op", False)):
            if receives:
                t.copy_(host)
            return work
        return _Carried(work, [(t, host)] if receives else [], keep=host)

    def _batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(ops: list[Any]) -> Any:
            if not self._top() or not ops:
                return original(ops)
            sends = self._originals[(c10d, "isend")]
            group = ops[0].group
            records = [("send" if op.op in (dist.isend, sends) else "recv", int(op.peer), op.tensor.numel(),
                        str(op.tensor.dtype), int(op.tag or 0)) for op in ops]
            info = self.record("batch_isend_irecv", group, [op.tensor for op in ops], records)
            if self.stand_in is not None and any(op.tensor.device.type == self.stand_in.type for op in ops):
                # gloo does not coalesce: torch's batch posts the operations one by one, as here
                def carried() -> list[Any]:
                    works = []
                    for op, (kind, *_rest) in zip(ops, records):
                        fn = self._originals[(c10d, "isend" if kind == "send" else "irecv")]
                        signature = inspect.signature(fn)
                        bound = signature.bind(op.tensor, op.peer, op.group, op.tag)
                        works.append(self._carry("isend" if kind == "send" else "irecv", fn, bound))
                    return works
                return self._inside(carried, info)
            return self._inside(lambda: original(ops), info)
        return wrapper

    def _functional(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._top():
                return original(*args, **kwargs)
            values = signature.bind(*args, **kwargs).arguments
            try:
                group = c10d._resolve_process_group(funcol._resolve_group_name(values["group"], values.get("tag", "")))
            except Exception:  # a form of group the audit cannot resolve: let torch say what is wrong
                return original(*args, **kwargs)
            tensors = [t for k, v in values.items() if k != "group" for t in _tensors(v)]
            info = self.record(f"functional {name}", group, tensors, [])
            return self._inside(lambda: original(*args, **kwargs), info)
        return wrapper

    def _new_group(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = signature.bind(*args, **kwargs).arguments
            group = original(*args, **kwargs)
            backend = str(values.get("backend") or "").lower()
            if isinstance(group, dist.ProcessGroup) and "gloo" in backend and "nccl" not in backend:
                self.explicit[group.group_name] = "gloo"
            return group
        return wrapper

    def install(self) -> None:
        """Wrap torch.distributed's calls in this process (idempotent per name)."""
        for name in COLLECTIVES + DEVICE_BY_TORCH:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            signature = inspect.signature(original)
            wrapper = self._collective(name, original, signature, name in DEVICE_BY_TORCH)
            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            self._originals[(c10d, name)] = original
            for module in (c10d, dist):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)
        self._wrap(c10d, "batch_isend_irecv", self._batch)
        dist.batch_isend_irecv = c10d.batch_isend_irecv
        for name in FUNCTIONAL:
            self._wrap(funcol, name, lambda original, name=name: self._functional(name, original))
        import torch.distributed.device_mesh as device_mesh

        self._wrap(c10d, "new_group", self._new_group)
        dist.new_group = c10d.new_group
        if getattr(device_mesh, "new_group", None) is self._originals[(c10d, "new_group")]:
            device_mesh.new_group = c10d.new_group
        if self.stand_in is not None:
            self._stand_in()
        atexit.register(self.dump)
        exit_now = os._exit

        def exit_after_dump(code: int) -> None:
            if os.getpid() == self.pid:
                self.dump()
            exit_now(code)
        os._exit = exit_after_dump

    def _stand_in(self) -> None:
        """Answer the code's question "where do this group's tensors go?" as a CUDA island would."""
        import peers.island.exchange as exchange

        lazy_device()
        exchange.backend_of = self.production_backend
        exchange.accelerator = lambda: self.stand_in

    # ---------------------------------------------------------------------------------- report
    def dump(self) -> None:
        """Write this rank's record (again: the last one written counts)."""
        rank = os.environ.get("RANK", "0")
        record = {"rank": int(rank), "pid": self.pid, "calls": self.calls, "groups": self.groups,
                  "violations": list(self.violations.values()), "p2p": self.p2p}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"audit.rank{rank}.{self.pid}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)


_recorder: Recorder | None = None


@functools.cache
def lazy_device() -> torch.device:
    """torch's lazy device, the stand-in for a GPU (its backend can be started once per process)."""
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device("lazy")


def install() -> Recorder | None:
    """Start recording in this process when ``DILOCO_COLLECTIVE_AUDIT`` names a folder (once per process)."""
    global _recorder
    out = os.environ.get(ENV, "")
    if not out or (_recorder is not None and _recorder.pid == os.getpid()):
        return _recorder
    _recorder = Recorder(out, os.environ.get(STAND_IN_ENV, ""))
    _recorder.install()
    return _recorder


# ---------------------------------------------------------------------------------- the parent's side
def records(out_dir: Path) -> list[dict[str, Any]]:
    """The records the ranks of one launch left in ``out_dir``."""
    return [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("audit.rank*.json"))]


def p2p_mismatches(ranks: list[dict[str, Any]]) -> list[str]:
    """Pairs of ranks whose point-to-point operations on a group were posted in orders that do not match one by
    one (NCCL pairs the k-th send from a rank to another with the k-th receive there, whatever the tags)."""
    problems = []
    by_rank = {r["rank"]: r["p2p"] for r in ranks}
    for rank, p2p in by_rank.items():
        for key, sends in p2p.items():
            group, kind, peer = key.split("|")
            if kind != "send" or int(peer) not in by_rank:
                continue
            recvs = by_rank[int(peer)].get(f"{group}|recv|{rank}", [])
            n = min(len(sends), len(recvs))
            for k in range(n):
                if sends[k] != recvs[k]:
                    problems.append(
                        f"group {group}: rank {rank}'s send #{k} to rank {peer} (numel, dtype, tag {sends[k]}) meets "
                        f"rank {peer}'s receive #{k} from it ({recvs[k]}): NCCL matches them by order, not by tag")
                    break
    return problems


def check(out_dir: Path) -> list[str]:
    """Every rule broken in one launch (empty: none), each in one line with where it was broken."""
    ranks = records(out_dir)
    problems = [f"rank {r['rank']}: {v['rule']}: {v['message']} ({v['count']}x, first at {v['where']})"
                for r in ranks for v in r["violations"]]
    return problems + p2p_mismatches(ranks)


def summary(out_dir: Path) -> dict[str, Any]:
    """What one launch did: its ranks, collectives, groups by production backend."""
    ranks = records(out_dir)
    groups: dict[str, str] = {}
    for r in ranks:
        groups.update({name: g["backend"] for name, g in r["groups"].items()})
    return {"ranks": len(ranks), "calls": sum(r["calls"] for r in ranks),
            "groups": {b: sum(1 for g in groups.values() if g == b) for b in sorted(set(groups.values()))}}

"""A late joiner and its death, as a user meets them: 2 islands of a 40M model with short rounds (H=2), a third
joins after round 2 and is SIGKILLed 3 rounds later.  Prints when the joiner caught up (at which outer step,
against the others' step then) and every island's rounds (outer step: ok or X / group size / seconds), so the
others' round after the kill shows whether they waited on the dead member.  Not a test.

    python -m experiments.late_joiner /tmp/late
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diloco.config import loader  # noqa: E402
from diloco.engine.metrics import read_metrics  # noqa: E402
from diloco.launch.simulate import Cluster  # noqa: E402


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/late")
    items = {"model.dim": 640, "model.n_layers": 8, "model.n_heads": 10, "model.ffn_dim": 1728, "model.seq_len": 128,
             "diloco.inner_steps": 2, "diloco.outer_steps": 14, "inner.batch_size": 4, "logging.run_dir": str(out),
             "logging.eval_batches": 1, "logging.samples": 0, "logging.eval_every": 100, "checkpoint.every": 0,
             "wandb.mode": "disabled", "averaging.min_group_size": 2, "averaging.wait_for_islands": 2,
             "averaging.matchmaking_time": 2.0, "averaging.request_timeout": 1.0, "inner.warmup_steps": 1}
    cfg = loader.load(None, items)
    cluster = Cluster(cfg, 3)
    t0 = time.time()

    def step(i: int) -> int:
        recs = [r for r in read_metrics(cluster.run_dirs[i]) if "round_ok" in r]
        return recs[-1]["outer_step"] if recs else 0

    try:
        cluster.start(0)
        peers = cluster.wait_reachable(0, 120)
        cluster.configs[1]["averaging"]["initial_peers"] = peers
        cluster.configs[2]["averaging"]["initial_peers"] = peers
        cluster.start(1)
        while step(0) < 2:
            time.sleep(0.5)
        print(f"[{time.time() - t0:5.1f}s] joiner starts; island0 at outer step {step(0)}", flush=True)
        cluster.start(2)
        caught = None
        while caught is None and cluster.alive(2):
            for line in cluster.logs[2].read_text().splitlines():
                if "caught up with the run at outer step" in line:
                    caught = line
            time.sleep(0.3)
        print(f"[{time.time() - t0:5.1f}s] {caught.split('INFO diloco: ')[-1] if caught else 'never caught up'}; "
              f"island0 at outer step {step(0)}", flush=True)
        target = step(0) + 3
        while step(0) < target:
            time.sleep(0.5)
        print(f"[{time.time() - t0:5.1f}s] joiner at outer step {step(2)} (island0 {step(0)}); SIGKILL joiner", flush=True)
        killed_at = step(0)
        cluster.kill(2)
        deadline = time.time() + 600
        while (cluster.alive(0) or cluster.alive(1)) and time.time() < deadline:
            time.sleep(1.0)
    finally:
        cluster.stop_all()
    for i in range(3):
        recs = [r for r in read_metrics(cluster.run_dirs[i]) if "round_ok" in r]
        print(f"island{i}: " + " ".join(f"{r['outer_step']}:{'ok' if r['round_ok'] else 'X'}/{r.get('num_peers', '?')}"
                                        f"/{r.get('allreduce_seconds', 0):.1f}s" for r in recs), flush=True)
    print(json.dumps({"killed_after_step": killed_at}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prototype (not in the repo): evaluate a finished run's global weights with the workers' held
error-feedback residuals applied at the end, as one more round would apply them.
usage: flush_eval.py RUN_DIR CHECKPOINT_EPOCH_DIR STEPS_PER_EPOCH OUT SCALE...
Writes OUT/flush.md and OUT/manifest.json (scripts/results_io.write_manifest)."""
import glob, os, sys
import numpy as np
import mxnet as mx
from ssdsgd.config import load_config
from ssdsgd.worker.data import data_from_config
from ssdsgd.worker.models import build_net, build_eval_net
from ssdsgd.worker.evaluate import count_correct
from ssdsgd.schedule import schedule_from_config
from ssdsgd.checkpoint import load_npz

run_dir, ck = sys.argv[1], sys.argv[2]
cfg = load_config(os.path.join(run_dir, "config.yaml"))
N, B = cfg.cluster.workers, cfg.train.batch_size
data = data_from_config(cfg, 0, N)
net, params = build_net(cfg, data.num_classes, data.image_shape)
net.load_parameters(os.path.join(run_dir, "final.params"))
eval_net = build_eval_net(cfg, net)
def acc():
    c, n = count_correct(eval_net, data.test, B)
    return c / n
a0 = acc()
held = {}
for f in sorted(glob.glob(os.path.join(ck, "worker*.npz"))):
    arrays = load_npz(f)
    arrays = arrays[0] if isinstance(arrays, tuple) else arrays
    for name, arr in arrays.items():
        if name.startswith("residual") and name[8:].lstrip("-").isdigit():
            held[int(name[8:])] = held.get(int(name[8:]), 0) + np.asarray(arr, np.float32).reshape(-1)
steps = cfg.train.epochs * data.steps_per_epoch if hasattr(data, "steps_per_epoch") else None
sched = schedule_from_config(cfg.train, int(sys.argv[3]))
T = cfg.train.epochs * int(sys.argv[3])
rate = sched(T) if sched(T) > 0 else sched(T - 1)
print("final rates", sched(T - 1), sched(T), "using", rate, "tensors held", len(held))
out = [f"{data.eval_set} accuracy as run: {a0:.4f}"]
for scale in [float(s) for s in sys.argv[5:]] or [1.0]:
    saved = [p.data().copy() for p in params]
    norm = 0.0
    for j, r in held.items():
        if j < 0:
            raise SystemExit("buffer-wide residual keys: fusion behind not handled")
        d = -scale * rate * r / (N * B)
        norm += float(np.dot(d, d))
        p = params[j]
        p.set_data(p.data() + mx.nd.array(d.reshape(p.shape)))
    out.append(f"flushed x{scale}: {acc():.4f} (displacement norm {norm ** 0.5:.4f})")
    for p, s in zip(params, saved):
        p.set_data(s)
print("\n".join(out))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__import__("ssdsgd").__file__)), "..", "scripts"))
import results_io
dest = results_io.results_folder(sys.argv[4])
results_io.write_text(os.path.join(dest, "flush.md"), "\n".join(
    [f"run {run_dir}, checkpoint {ck}; held values applied at rate {rate:.3g} (the last round's), scaled by x"] + out))
results_io.write_manifest(dest, [os.path.join(run_dir, "config.yaml")], training="run/manifest.json")

"""Probe MXNet's own 2-bit gradient compression on dist_sync: push, then pull, compare with the expected round.

    python launch/launch.py -n 4 -s 4 python bench/probe_2bit.py [--nrep 7] [--waitall] [--wait-before-push]

Every worker pulls a key, pushes a random gradient (all workers the same one), pulls again, and checks that
the difference is the 2-bit quantized gradient (with its residual) x workers x rescale, as MXNet's nightly
`dist_sync_kvstore.py --type=compressed_cpu` (check_compr_random) does. Prints each mismatch and, per worker,
`rank R bad N`; exits 1 if any worker saw a mismatch. Uses MXNet's stock server loop (no ssdsgd code).
"""
import argparse
import os
import sys

import mxnet as mx
import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--nrep", type=int, default=7)
ap.add_argument("--waitall", action="store_true", help="mx.nd.waitall() between the push and the pull")
ap.add_argument("--wait-before-push", action="store_true",
                help="wait for the first pull to arrive before pushing (MXNet's check does not)")
args = ap.parse_args()

kv = mx.kv.create("dist_sync")
rate, threshold = 2, 0.5
kv.set_optimizer(mx.optimizer.create("test", rescale_grad=rate))   # weight += rate * merged gradient
kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
rng = np.random.RandomState(123)
bad = 0
for key, shape in ((1002, (2, 3)), (1202, (300, 300))):
    kv.init(key, mx.nd.zeros(shape))
    residual = np.zeros(shape)
    for i in range(args.nrep):
        before = mx.nd.zeros(shape)
        kv.pull(key, out=before)
        if args.wait_before_push:
            before.wait_to_read()
        grad = rng.rand(*shape)
        kv.push(key, mx.nd.array(grad))
        if args.waitall:
            mx.nd.waitall()
        after = mx.nd.zeros(shape)
        kv.pull(key, out=after)
        residual += grad
        sent = np.where(residual >= threshold, threshold, np.where(residual <= -threshold, -threshold, 0.0))
        residual -= sent
        want = sent * kv.num_workers * rate
        got = (after - before).asnumpy()
        if not np.allclose(got, want, atol=1e-5):
            bad += 1
            print(f"mismatch: rank {kv.rank} key {key} repeat {i}: got {got.flat[0]:g}, want {want.flat[0]:g}",
                  flush=True)
print(f"rank {kv.rank} bad {bad} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})", flush=True)
if bad:
    sys.stdout.flush()
    os._exit(1)   # a normal exit would wait in ps-lite's finalize for the other workers

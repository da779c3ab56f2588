"""One distributed SGD step of a row_sparse weight through gluon's Trainer on a dist_sync KVStore (the
servers update the weight): worker r's gradient is r + 1 in every row, the learning rate 1, so every
worker must then hold 1 - (1 + 2 + ... + W). Prints `rank R sparse step passed` or exits 1."""
import sys

import mxnet as mx
import numpy as np

kv = mx.kv.create("dist_sync")
rows = mx.nd.arange(0, 4)
weight = mx.gluon.Parameter("weight", shape=(4, 6), stype="row_sparse", grad_stype="row_sparse")
weight.initialize(ctx=mx.cpu(), init="ones")
trainer = mx.gluon.Trainer([weight], "sgd", {"learning_rate": 1.0}, kvstore=kv)
with mx.autograd.record():
    out = weight.row_sparse_data(rows) * (kv.rank + 1)
out.backward()
trainer.step(1)
got = weight.row_sparse_data(rows).asnumpy()
want = 1.0 - kv.num_workers * (kv.num_workers + 1) / 2
if not np.allclose(got, want):
    print(f"rank {kv.rank} sparse step FAILED: got {got.ravel()[:4]}, want {want}", flush=True)
    sys.exit(1)
print(f"rank {kv.rank} sparse step passed", flush=True)

"""MXNet's profiler on servers and workers of a dist_sync job: each worker profiles itself into
rank<R>_worker_profile.json and has the servers profile themselves into rank<S>_server_profile.json.
MXNet writes a profile when the process exits. With --check-in-run, rank 0 opens every file before it
exits, which fails under any launcher (its own file is not written yet)."""
import json
import sys

import mxnet as mx

kv = mx.kv.create("dist_sync")
mx.profiler.set_config(filename="server_profile.json", profile_all=True, profile_process="server")
mx.profiler.set_config(filename=f"rank{kv.rank}_worker_profile.json", profile_all=True, profile_process="worker")
for process in ("server", "worker"):
    mx.profiler.set_state(state="run", profile_process=process)
kv.init("7", mx.nd.ones((64, 64)))
for _ in range(5):
    kv.push("7", mx.nd.ones((64, 64)) * (kv.rank + 1))
    value = mx.nd.zeros((64, 64))
    kv.pull("7", out=value)
    mx.nd.waitall()
for process in ("server", "worker"):
    mx.profiler.set_state(state="stop", profile_process=process)
if "--check-in-run" in sys.argv and kv.rank == 0:
    for name in [f"rank{r}_worker_profile.json" for r in range(kv.num_workers)] + ["rank0_server_profile.json"]:
        with open(name) as f:
            json.load(f)
print(f"rank {kv.rank} profiled", flush=True)

"""A cost model of the system: step time from per-step compute, bytes per role and direction, link
rate and server cost per value (issue 36, item 7).

Bytes come from the project's own code, never from re-derived formulas: the buffer plan
(compression.fusion.plan_for_config, tensor_counts), each buffer's mailbox message
(Buffer.wire = codec.WireFormat) and each buffer's downlink ring (algorithms.downlink.ring_choice ->
ps.ring.RingLayout), for the config a layout runs with (bench_network's algorithm overrides, N
workers, S servers). SSGD (MXNet's stock dist_sync) pushes and pulls the dense model each step.
On the wire every payload byte costs FRAME/MSS (TCP/IP/Ethernet headers) plus one ACK per two
segments coming back. Per layout (N workers, S servers, one link per host at `rate` each way):

  SSGD on the PS    t = compute + A + B - overlap * min(A, B) + server CPU + 3 latencies
                    A = max(worker up, server rx) / rate, B = max(server tx, worker down) / rate
                    (MXNet pipelines pushes and pulls per key; `overlap` is the one fitted number,
                    see --fit-on: the rows it is fitted on are marked in-sample)
  SSD-SGD (+top-k)  t = max(compute + the worker's encode and replica update, each link direction
                    / rate, the busiest server's CPU per round): communication overlaps compute (a
                    worker waits only when it falls more than S steps behind)
  ring all-reduce   t = compute + 2(N-1)/N * model bytes (on the wire) / rate + 2(N-1) latencies, the
                    compute phase shared among the workers on a shared machine as SSGD's is (checked against
                    measured Horovod by bench/ring_check.py)
  virtual cluster   every role shares the machine's cores: t >= (N * worker CPU + S * server CPU)
                    / (cores * (1 - the run's other_cpu_share)) for SSD-SGD; SSGD's compute phase
                    shares them among the workers (its servers work after it, while the workers wait)

  CPU per message    the round-based roles' CPU grows with the messages they exchange (a push, clock
                    polls and a pull per worker and server every step), which the per-value and per-byte
                    costs miss: all servers' CPU per step gains server_per_worker * N + server_per_pair * N * S,
                    and on a shared machine each worker's CPU per step is (1 + worker_per_process * (N + S))
                    times the lone worker's (the roles share caches and the scheduler's time slices)

Measured inputs: the single worker's compute time and CPU (bench_network's compute_bound rows, pooled over
the runs files measured on the same machine with the same config: one compute-bound run varies by about
13% between runs), the server's CPU per byte (the same rows: server CPU per step less its round, per byte
on its link), the server's CPU per round per value (results/bench_server/fits.csv), the worker's encode
per step (results/bench_selection/bench.csv). Fitted: `overlap` (its rows are marked in-sample) and the
three CPU-per-message terms, by least squares on the round-based runs' measured CPU per step; each runs
file is validated with the terms fitted on the other files only (leave one file out), so no validated
row is fitted on itself (with one runs file only, its rows are marked in-sample).
Projections replace the compute with published GPU step times (PUBLISHED, cited), assume the hosts'
network stacks keep up with the link (no CPU per byte) and keep the servers' CPU per message fitted on
all the runs given (none without runs: `project` alone).

Usage:
  python bench/scaling_model.py validate results/hosts_steps60_v2/runs.csv [more runs.csv ...]
  python bench/scaling_model.py project [runs.csv ...]   # the runs fit the servers' CPU per message
  python bench/scaling_model.py all results/hosts_steps60_v2/runs.csv   # both; what the folder holds
Options: --out DIR (default results/scaling_model), --config / --set (the base config and overrides the
benchmark ran with; default: read from the manifest.json next to each runs.csv, else bench_network's),
--fit-on RUNS.csv (the SSGD rows `overlap` is fitted on), --cores (of the machine the runs ran on).
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from bench.bench_network import ALGORITHMS, COMPUTE_BOUND_SETS, DEFAULT_CONFIG
from bench.bench_server import MODELS
from scripts.results_io import (COMPUTE_BOUND, rate_name, read_csv, results_folder, write_csv, write_manifest,
                                write_text)

FRAME, MSS, ACK, SEGMENTS_PER_ACK = 1514, 1448, 66, 2     # Ethernet frame of a full TCP segment, its ACK
OUT = "results/scaling_model"
FIT_ON = "results/hosts_steps60_v2/runs.csv"
SERVER_FITS = "results/bench_server/fits.csv"
SELECTION = "results/bench_selection/bench.csv"
BENCH_MODEL = {"cifar_resnet20_v1": "resnet20", "resnet50_v1": "resnet50"}   # model -> bench_server/selection
SAMPLE_SHAPE = {"cifar_resnet20_v1": (3, 32, 32), "resnet50_v1": (3, 224, 224)}
NEEDED = ("algorithm", "status", "rate_mbit", "num_workers", "steady_images_per_sec")

# Published single-GPU training step times the projections use as the compute of one worker.
PUBLISHED = {
    "resnet20": dict(
        config="configs/cifar10_resnet20_ssd_topk.yaml", batch=128, step_seconds=16.2 / (50000 / 128),
        source="https://raw.githubusercontent.com/dmlc/web-data/master/gluoncv/logs/classification/cifar/"
               "cifar_resnet20_v1.log",
        figure="GluonCV's cifar_resnet20_v1 training log (MXNet, 1 GPU, batch 128, hybridized): about 16.2 s "
               "per 50,000-image epoch (epochs 0-9: 15.9-16.5 s), 41 ms per step; the GPU model is not "
               "stated in the log"),
    "resnet50": dict(
        config="configs/imagenet_resnet50_ssd_topk.yaml", batch=192, step_seconds=192 / 1376,
        source="https://github.com/NVIDIA/DeepLearningExamples/blob/master/MxNet/Classification/RN50v1.5/"
               "README.md",
        figure="NVIDIA DeepLearningExamples, MXNet ResNet-50 v1.5, training performance on DGX-1 (V100 16GB), "
               "1 GPU, mixed precision, batch 192: 1,376 img/s (139.5 ms per step); v1.5 is ~5% slower "
               "than the v1 the project trains"),
}
PROJECT_N = (16, 32, 64, 128)
PROJECT_GBIT = (1, 10, 100)
STOCK_BIGARRAY_BOUND = 1000 * 1000    # MXNet's default MXNET_KVSTORE_BIGARRAY_BOUND (the stock client keeps it)
LATENCY = 25e-6       # assumed one-way latency per message on a real network (s); 0 on the virtual cluster


class ModelError(Exception):
    """Bad input: printed as one line, exit status 2."""


# ------------------------------------------------------------------------------------------ bytes

_SHAPES = {}


def model_shapes(cfg):
    """Parameter shapes of the config's model in the worker's order (one forward pass fixes them)."""
    name = cfg.model.name
    if name not in _SHAPES:
        from ssdsgd.worker.models import parameter_shapes
        shape = tuple(cfg.data.shape or SAMPLE_SHAPE.get(name, (3, 32, 32)))
        _SHAPES[name] = parameter_shapes(name, cfg.data.num_classes or 10, shape)
    return _SHAPES[name]


def wire(payload, reverse=0.0):
    """Bytes one direction of a link carries for `payload` bytes of data sent that way and `reverse`
    bytes sent the other way (whose ACKs come this way)."""
    return payload * FRAME / MSS + reverse / (MSS * SEGMENTS_PER_ACK) * ACK


def dense_bytes(shapes, workers, servers):
    """SSGD on MXNet's stock dist_sync: each worker pushes and pulls every value each step, one key per
    parameter (key = its index). MXNet puts key i on server (i * KEY_HASH) % S, except an array of at
    least MXNET_KVSTORE_BIGARRAY_BOUND elements, which it splits evenly over all servers."""
    from ssdsgd.ps.keys import KEY_HASH
    sizes = [_numel(s) for s in shapes]
    load = [0.0] * servers
    for key, size in enumerate(sizes):
        if size >= STOCK_BIGARRAY_BOUND:
            load = [v + size / servers for v in load]
        else:
            load[(key * KEY_HASH) % servers] += size
    per_server = max(load)
    return dict(push=4.0 * sum(sizes), pull=4.0 * sum(sizes), server_rx=4.0 * workers * per_server,
                server_tx=4.0 * workers * per_server, server_values=workers * per_server,
                server_size=per_server, server_dense=workers * per_server, squeezed=0, values=sum(sizes),
                downlink="dense")


def round_bytes(shapes, cfg, workers, servers):
    """Bytes per step of the round-based client (SSD-SGD, compressed SSGD), per worker and for the busiest
    server, from the buffer plan, the mailbox formats and the downlink rings the code builds."""
    from ssdsgd.algorithms.downlink import ring_choice, ring_slots
    from ssdsgd.compression.fusion import plan_for_config, tensor_counts
    from ssdsgd.ps.keys import place_buffers
    from ssdsgd.config import RING_DOWNLINKS
    comp, alg = cfg.compression, cfg.algorithm
    try:
        buffers = place_buffers(plan_for_config(shapes, servers, comp, counted=tensor_counts(shapes, comp)), servers)
    except ValueError as e:
        raise ModelError(f"buffer plan of {cfg.model.name} on {servers} server(s): {e}") from None
    ssd = alg.type == "ssd"
    delay = alg.delay if ssd else 1
    slots = ring_slots(alg)
    rings = comp.downlink in RING_DOWNLINKS and buffers[0].codec == "sparse"
    per = {}
    kinds = set()
    for b in buffers:
        kind, layout = ring_choice(comp, slots, b.size, b.topk_count, workers) if rings else ("dense", None)
        pull = 4.0 * (b.size + 1) if kind == "dense" else 4.0 * layout.length
        kinds.add(kind)
        s = per.setdefault(b.server, dict(push=0.0, pull=0.0, values=0, size=0, squeezed=0, dense=0))
        s["push"] += b.wire.bytes
        s["pull"] += pull / delay
        s["values"] += workers * b.topk_count
        s["dense"] += workers * b.topk_count if b.codec == "dense" else 0
        s["size"] += b.size
        s["squeezed"] += b.size if kind == "compressed" else 0
    busiest = max(per.values(), key=lambda s: workers * (s["push"] + s["pull"]))
    return dict(push=sum(s["push"] for s in per.values()), pull=sum(s["pull"] for s in per.values()),
                server_rx=workers * busiest["push"], server_tx=workers * busiest["pull"],
                server_values=busiest["values"], server_dense=busiest["dense"], server_size=busiest["size"],
                squeezed=busiest["squeezed"], values=sum(b.size for b in buffers),
                downlink="+".join(sorted(kinds)), replica=rings)


def ring_allreduce_bytes(values, workers, value_bytes=4.0):
    """Ring all-reduce (Horovod): each worker sends and receives 2(N-1)/N of the model per step
    (value_bytes a value: 4 for fp32, 2 with Horovod's fp16 compression)."""
    return 2.0 * (workers - 1) / workers * value_bytes * values


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ----------------------------------------------------------------------------------- measured costs

def _read_csv(path, needed=()):
    if not os.path.isfile(path):
        raise ModelError(f"{path}: file not found")
    try:
        return read_csv(path, needed)
    except ValueError as e:
        raise ModelError(str(e)) from None


def server_costs(model, path=os.path.join(ROOT, SERVER_FITS)):
    """Seconds per value of the servers' round (bench_server's linear fits over the worker counts, the
    current code): `apply` per value of the buffer (the intercept: the O(size) update once a round),
    `sparse` / `dense` per value received."""
    rows = [r for r in _read_csv(path, ("sweep", "model", "codec", "impl", "intercept_ms", "slope_ns_per_value"))
            if r["sweep"] == "workers" and r["impl"] == "new" and r["model"] == model]
    fits = {r["codec"]: r for r in rows}
    if set(fits) != {"sparse", "dense"}:
        raise ModelError(f"{path}: no 'workers' fits (new, sparse and dense) for {model}")
    return dict(apply=float(fits["dense"]["intercept_ms"]) * 1e-3 / MODELS[model],
                sparse=float(fits["sparse"]["slope_ns_per_value"]) * 1e-9,
                dense=float(fits["dense"]["slope_ns_per_value"]) * 1e-9)


def encode_seconds(model, selection, path=os.path.join(ROOT, SELECTION)):
    """The worker's selection and encoding per step, CPU seconds (bench_selection, this model's config)."""
    rows = [r for r in _read_csv(path, ("model", "selection", "encode_cpu_ms"))
            if r["model"] == model and r["selection"] == selection]
    if not rows:
        raise ModelError(f"{path}: no row for model {model}, selection {selection}")
    return float(rows[0]["encode_cpu_ms"]) * 1e-3


def worker_extra(cfg, b):
    """CPU seconds per step the round-based worker adds to the compute: its encode (a sparsifier) and the
    replica's update from the ring (the servers' O(size) apply, once per round)."""
    from ssdsgd.compression.registry import is_sparsifier
    if not is_sparsifier(cfg.compression.type):
        return 0.0
    model = BENCH_MODEL.get(cfg.model.name)
    if model is None:
        raise ModelError(f"model {cfg.model.name}: no measured encode or server costs (measured: "
                         f"{', '.join(BENCH_MODEL)})")
    # the replica applies every round (a pull every k steps brings k of them): one apply per step
    replica = server_costs(model)["apply"] * b["values"] if b.get("replica") else 0.0
    return encode_seconds(model, cfg.compression.selection) + replica


def server_seconds(cfg, b, per_byte):
    """CPU seconds per step of the busiest server: its round (apply + per value received), the
    compressed downlink's top-k of each round (estimated as the worker's exact selection over as many
    values), and `per_byte` seconds per byte on its link."""
    model = BENCH_MODEL.get(cfg.model.name)
    if model is None:
        raise ModelError(f"model {cfg.model.name}: no measured server costs (measured: {', '.join(BENCH_MODEL)})")
    c = server_costs(model)
    sparse_values = b["server_values"] - b["server_dense"]
    t = c["apply"] * b["server_size"] + c["sparse"] * sparse_values + c["dense"] * b["server_dense"]
    if b["squeezed"]:
        t += encode_seconds(model, "exact") * b["squeezed"] / MODELS[model]
    return t + per_byte * (b["server_rx"] + b["server_tx"])


# ------------------------------------------------------------------------------------------ times

def link_seconds(b, rate):
    """Seconds per step each host link direction is busy: worker up/down, busiest server rx/tx."""
    if not rate:
        return dict(worker_up=0.0, worker_down=0.0, server_rx=0.0, server_tx=0.0)
    return dict(worker_up=wire(b["push"], b["pull"]) / rate, worker_down=wire(b["pull"], b["push"]) / rate,
                server_rx=wire(b["server_rx"], b["server_tx"]) / rate,
                server_tx=wire(b["server_tx"], b["server_rx"]) / rate)


def cpu_share(lay, servers=True):
    """Seconds per step all roles' CPU needs on the shared machine (0: each role has its own host);
    servers=False: the workers' only."""
    if not lay.get("cores"):
        return 0.0
    busy = lay["workers"] * (lay["cpu_w"] + lay["extra"]) + (lay["servers_used"] * lay["server"] if servers else 0.0)
    return busy / lay["cores"]


def ssgd_compute(lay):
    """Seconds of SSGD's compute phase. Its phases are synchronous: every worker computes while the
    servers wait for the pushes, then the servers work while the workers wait; so on a shared machine
    the compute phase shares the cores among the workers only, and the servers' CPU comes after it."""
    return max(lay["t_c"], cpu_share(lay, servers=False))


def ssgd_step(lay, overlap):
    """(seconds, what limits) of a step of SSGD on the parameter servers."""
    links = link_seconds(lay["bytes"], lay["rate"])
    a = max(links["worker_up"], links["server_rx"])
    b = max(links["server_tx"], links["worker_down"])
    comm = a + b - overlap * min(a, b)
    compute = ssgd_compute(lay)
    t = compute + comm + lay["server"] + 3 * lay["latency"]
    limit = "links" if comm > compute else "compute"
    return t, limit


def ssd_step(lay):
    """(seconds, what limits) of a step of SSD-SGD: communication and the servers overlap compute."""
    terms = dict(compute=lay["t_c"] + lay["extra"], server_cpu=lay["server"], shared_cpu=cpu_share(lay),
                 **link_seconds(lay["bytes"], lay["rate"]))
    limit = max(terms, key=terms.get)
    return terms[limit], limit


def ring_step(lay):
    """(seconds, what limits) of a step of ring all-reduce (Horovod) on the same links. Its phases are
    synchronous like SSGD's, so on a shared machine its compute phase shares the cores among the workers
    (ssgd_compute; with one host per role, as in the projections, that is the worker's own compute)."""
    n = lay["workers"]
    sent = ring_allreduce_bytes(lay["bytes"]["values"], n, lay.get("value_bytes", 4.0))
    comm = (wire(sent, sent) / lay["rate"] if lay["rate"] else 0.0) + 2 * (n - 1) * lay["latency"]
    compute = ssgd_compute(lay)
    return compute + comm, "links" if comm > compute else "compute"


def layout(cfg, workers, servers, rate, measured, kind=None):
    """Everything a step time needs for `cfg` with N workers and S servers on links of `rate` bytes/s
    (0: unlimited); `measured`: t_c (compute seconds of one worker alone), cpu_w, per_byte (server
    CPU per link byte), cores (None: one host per role), latency."""
    from ssdsgd.config import runner_of
    from ssdsgd.registry import STOCK
    kind = kind or ("ssgd" if runner_of(cfg).plan == STOCK else "ssd")
    shapes = model_shapes(cfg)
    if kind == "ssd":
        b = round_bytes(shapes, cfg, workers, servers)
        extra = worker_extra(cfg, b)
    else:
        b = dense_bytes(shapes, workers, servers)
        extra = 0.0
    lay = dict(kind=kind, workers=workers, servers=servers, rate=rate, bytes=b, extra=extra,
               servers_used=servers, **measured)
    lay["server"] = 0.0 if kind == "ring" else server_seconds(cfg, b, measured["per_byte"])
    return with_message_cpu(lay, measured.get("terms"))


def with_message_cpu(lay, terms):
    """`lay` with the round-based roles' CPU per message (fit_message_cpu's terms; None: unchanged)."""
    if not terms or lay["kind"] != "ssd":
        return lay
    n, s = lay["workers"], lay["servers"]
    # each worker's messages reach every server: the busiest server's share is the mean
    server = (terms["server_per_worker"] * n + terms["server_per_pair"] * n * s) / s
    grow = 1.0 + terms["worker_per_process"] * (n + s) if lay.get("cores") else 1.0
    return dict(lay, server=lay["server"] + server, cpu_w=lay["cpu_w"] * grow, extra=lay["extra"] * grow)


def fit_message_cpu(samples):
    """The CPU-per-message terms, least squares over `samples` (lay without the terms, measured CPU per
    step of all servers, measured CPU per step of a worker) of round-based runs on a shared machine; None
    without samples. Terms that come out negative are set to 0 (CPU cannot shrink with messages)."""
    import numpy as np
    if not samples:
        return None
    x = np.array([[lay["workers"], lay["workers"] * lay["servers"]] for lay, _, _ in samples], float)
    y = np.array([servers - lay["server"] * lay["servers_used"] for lay, servers, _ in samples])
    (per_worker, per_pair), *_ = np.linalg.lstsq(x, y, rcond=None)
    procs = [lay["workers"] + lay["servers"] for lay, _, _ in samples]
    grow = [worker / (lay["cpu_w"] + lay["extra"]) - 1.0 for lay, _, worker in samples]
    per_process = sum(g * p for g, p in zip(grow, procs)) / sum(p * p for p in procs)
    return dict(server_per_worker=max(0.0, float(per_worker)), server_per_pair=max(0.0, float(per_pair)),
                worker_per_process=max(0.0, per_process))


def describe_terms(terms):
    return (f"servers {terms['server_per_worker'] * 1e3:.2f} ms per worker + {terms['server_per_pair'] * 1e3:.2f} "
            f"ms per worker and server, workers +{terms['worker_per_process'] * 100:.2f}% per process")


def step(lay, overlap):
    if lay["kind"] == "ring":
        return ring_step(lay)
    return ssgd_step(lay, overlap) if lay["kind"] == "ssgd" else ssd_step(lay)


# ------------------------------------------------------------------------------------- validation

def _num(v, default=None):
    try:
        return float(v) if v not in (None, "") else default
    except ValueError:
        return default


def bench_setup(runs_path, args):
    """(base config, overrides) the benchmark of a runs.csv ran with: --config / --set given here, else
    the command in the manifest.json next to it, else bench_network's default config."""
    config, sets = args.config, list(args.set)
    manifest = os.path.join(os.path.dirname(os.path.abspath(runs_path)), "manifest.json")
    if config is None and os.path.isfile(manifest):
        with open(manifest) as f:
            command = json.load(f).get("command") or []
        for flag, value in zip(command, command[1:]):
            if flag == "--config":
                config = value
            elif flag == "--set" and not args.set:
                sets.append(value)
    config = config or DEFAULT_CONFIG
    return (config if os.path.isabs(config) else os.path.join(ROOT, config)), sets


def load(config, sets):
    from ssdsgd.config import ConfigError, load_config
    try:
        return load_config(config, sets)
    except ConfigError as e:
        raise ModelError(str(e)) from None


def algorithm_config(alg, workers, servers, config, sets):
    """The config a bench_network algorithm key ran with (None: a key this checkout does not know)."""
    if alg not in ALGORITHMS:
        return None
    return load(config, [*sets, *ALGORITHMS[alg][1], f"cluster.workers={workers}", f"cluster.servers={servers}"])


def measured_compute(rows, path, config, sets):
    """The single worker's compute (wall and CPU seconds per step) and the server's CPU per link byte,
    from the runs' compute_bound rows (1 worker, 1 server, no pulls, dense asynchronous pushes)."""
    cb = [r for r in rows if r["algorithm"] == COMPUTE_BOUND and r["status"] == "ok"]
    if not cb:
        raise ModelError(f"{path}: no ok {COMPUTE_BOUND} row (the single worker's compute time the model "
                         f"needs); pass --compute-bound RUNS.csv")
    cfg = load(config, [*sets, *COMPUTE_BOUND_SETS])
    t_c = cfg.train.batch_size / statistics.median(_num(r["steady_images_per_sec"]) for r in cb)
    cpu = [_num(r.get("steady_worker_cpu_seconds_per_step")) for r in cb]
    cpu_w = statistics.median(c for c in cpu if c) if any(cpu) else t_c
    b = round_bytes(model_shapes(cfg), cfg, 1, 1)
    server = [_num(r.get("steady_server_cpu_seconds_per_step")) for r in cb]
    per_byte = 0.0
    if any(server):
        rest = statistics.median(s for s in server if s) - server_seconds(cfg, b, 0.0)
        per_byte = max(0.0, rest / (b["server_rx"] + b["server_tx"]))
    return dict(t_c=t_c, cpu_w=cpu_w, per_byte=per_byte, batch=cfg.train.batch_size, runs=len(cb))


def _run_inputs(measured, cores, terms=None):
    """layout's `measured` for a run on the virtual cluster (no latency) with `cores` free cores."""
    return dict(t_c=measured["t_c"], cpu_w=measured["cpu_w"], per_byte=measured["per_byte"], cores=cores,
                latency=0.0, terms=terms)


def predict_row(row, cfg, measured, overlap, cores):
    """Predicted figures of one measured run (a hosts-topology row)."""
    n, s = int(_num(row["num_workers"])), int(_num(row.get("num_servers"), 1))
    rate = _num(row["rate_mbit"], 0.0) * 1e6 / 8
    free = cores * (1.0 - _num(row.get("other_cpu_share"), 0.0))
    lay = layout(cfg, n, s, rate, _run_inputs(measured, free, measured.get("terms")))
    t, limit = step(lay, overlap)
    b = lay["bytes"]
    # A diagnostic, not a prediction: the same model given the CPU per step the run itself measured
    # (each worker's, and all servers' spread evenly), which separates the model's structure from its
    # CPU inputs.
    wcpu = _num(row.get("steady_worker_cpu_seconds_per_step"))
    scpu = _num(row.get("steady_server_cpu_seconds_per_step"))
    with_cpu = None
    if wcpu and scpu:
        t_cpu, _ = step(dict(lay, cpu_w=wcpu - lay["extra"], server=scpu / lay["servers_used"]), overlap)
        with_cpu = n * cfg.train.batch_size / t_cpu
    return dict(images_per_sec=n * cfg.train.batch_size / t, limit=limit,
                server_cpu=lay["server"] * lay["servers_used"], images_per_sec_measured_cpu=with_cpu,
                server_tx=wire(b["server_tx"], b["server_rx"]), server_rx=wire(b["server_rx"], b["server_tx"]),
                worker_rx=wire(b["pull"], b["push"]), worker_tx=wire(b["push"], b["pull"]), lay=lay)


def runs_of(path, args):
    """(rows, config, sets, measured compute) of one runs.csv; the compute-bound rows are --compute-bound's,
    else those of every runs file given (args.pool) measured on the same machine with the same config."""
    rows = _read_csv(path, NEEDED)
    config, sets = bench_setup(path, args)
    args.configs_used = sorted(set(getattr(args, "configs_used", [])) | {config})
    if args.compute_bound:
        return rows, config, sets, measured_compute(_read_csv(args.compute_bound, NEEDED), args.compute_bound,
                                                    config, sets)
    here = os.path.abspath(path)
    pools = getattr(args, "pool", {})
    key = pools.get(here) or _pool_key(path, config, sets)
    others = [p for p, k in pools.items() if k == key and p != here]
    cb_rows = rows + [r for p in others for r in _read_csv(p, NEEDED)]
    measured = measured_compute(cb_rows, path, config, sets)
    return rows, config, sets, dict(measured, files=1 + len(others))


def pool_keys(paths, args):
    """{absolute path: _pool_key} of the runs files given: runs_of pools the compute-bound runs of the
    files with one key."""
    return {os.path.abspath(p): _pool_key(p, *bench_setup(p, args)) for p in paths}


def _pool_key(path, config, sets):
    """What must match for two runs files to share their compute-bound runs: the machine (the manifest
    next to each; none: not shared), the base config and the overrides other than the cluster's size (the
    compute-bound job is always 1 worker and 1 server)."""
    manifest = os.path.join(os.path.dirname(os.path.abspath(path)), "manifest.json")
    machine = None
    if os.path.isfile(manifest):
        with open(manifest) as f:
            machine = json.load(f).get("machine")
    own = None if machine else os.path.abspath(path)
    kept = tuple(sorted(x for x in sets if not x.startswith("cluster.")))
    return own, json.dumps(machine, sort_keys=True), config, kept


def _hosts_ok(rows):
    """The ok runs of the per-host topology, compute_bound rows left out."""
    return [r for r in rows if r["status"] == "ok" and r["algorithm"] != COMPUTE_BOUND
            and (r.get("topology") or "loopback") == "hosts"]


def fit_overlap(path, args):
    """`overlap` of SSGD (how much of the pull direction hides behind the push direction) fitted on the
    SSGD runs of one runs.csv: the median over its runs of the value that makes the model's step time
    the measured one, clipped to [0, 1]. Returns (overlap, the in-sample runs as (path, repeat, rate,
    N, S) keys, a description)."""
    rows, config, sets, measured = runs_of(path, args)
    ssgd = [r for r in _hosts_ok(rows) if r["algorithm"] == "ssgd"]
    if not ssgd:
        raise ModelError(f"{path}: no ok ssgd run on per-host links to fit the SSGD overlap on (--fit-on)")
    values, bounds = [], []
    for r in ssgd:
        cfg = algorithm_config("ssgd", int(_num(r["num_workers"])), int(_num(r.get("num_servers"), 1)), config, sets)
        p = predict_row(r, cfg, measured, 0.0, args.cores)
        lay = p["lay"]
        links = link_seconds(lay["bytes"], lay["rate"])
        a, b = max(links["worker_up"], links["server_rx"]), max(links["server_tx"], links["worker_down"])
        measured_t = lay["workers"] * cfg.train.batch_size / _num(r["steady_images_per_sec"])
        rest = ssgd_compute(lay) + lay["server"]
        values.append((a + b - (measured_t - rest)) / min(a, b) if min(a, b) else 0.0)
        bounds.append((measured_t / (rest + a + b) - 1, measured_t / (rest + max(a, b)) - 1))
    overlap = min(1.0, max(0.0, statistics.median(values)))
    keys = {_key(path, r) + (r["repeat"],) for r in ssgd}
    serial, full = (statistics.median(e[i] for e in bounds) for i in (0, 1))
    note = (f"SSGD overlap {overlap:.2f}, fitted on {len(ssgd)} SSGD run(s) of {_show(path)} "
            f"(per run: {', '.join(f'{v:.2f}' for v in values)}); those runs are in-sample (unfitted, their "
            f"error would be {_pct(serial)} with push and pull in series, overlap 0, and {_pct(full)} fully "
            f"overlapped, overlap 1)")
    return overlap, keys, note


def _show(path):
    """A path as the tables print it: relative to the checkout when inside it."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return path if rel.startswith("..") else rel


def _key(path, r):
    return (os.path.abspath(path), r["algorithm"], int(_num(r["num_workers"])), int(_num(r.get("num_servers"), 1)),
            _num(r["rate_mbit"], 0.0))


def _modelled(r):
    """(topology, N, S) of a measured row."""
    return r.get("topology") or "loopback", int(_num(r["num_workers"])), int(_num(r.get("num_servers"), 1))


def message_samples(rows, config, sets, measured, cores):
    """fit_message_cpu's samples of one runs file: its ok round-based runs on per-host links with both
    CPU figures, each with the model's layout without the CPU-per-message terms."""
    out = []
    for r in _hosts_ok(rows):
        _, n, s = _modelled(r)
        cfg = algorithm_config(r["algorithm"], n, s, config, sets)
        servers, worker = (_num(r.get(f"steady_{role}_cpu_seconds_per_step")) for role in ("server", "worker"))
        if cfg is None or not (servers and worker):
            continue
        lay = layout(cfg, n, s, 0.0, _run_inputs(measured, cores))
        if lay["kind"] == "ssd":
            out.append((lay, servers, worker))
    return out


def fit_per_file(files, cores):
    """{path: (terms, in-sample)}: each runs file's CPU-per-message terms fitted on the other files' runs
    (leave one file out); on its own runs, in-sample, when no other file has any. And the fit on all."""
    samples = {path: message_samples(rows, config, sets, measured, cores)
               for path, rows, config, sets, measured in files}
    every = [x for xs in samples.values() for x in xs]
    fits = {}
    for path in samples:
        others = fit_message_cpu([x for p, xs in samples.items() if p != path for x in xs])
        own = None if others else fit_message_cpu(samples[path])
        fits[path] = (others, False) if others else (own, own is not None)
    return fits, fit_message_cpu(every)


def validate(paths, args, overlap, in_sample):
    """One row per measured layout (runs.csv, algorithm, N, S, rate): medians over its repeats of the
    measured and the predicted figures, and the error. Rows the model does not cover are listed with why.
    Returns (rows, notes, the CPU-per-message terms fitted on every file, a line describing the fits)."""
    files = [(path, *runs_of(path, args)) for path in paths]
    fits, every = fit_per_file(files, args.cores)
    groups, skipped = {}, {}
    for path, rows, config, sets, measured in files:
        terms, own = fits[path]
        print(f"{path}: {len(rows)} rows; compute of one worker {measured['t_c'] * 1e3:.1f} ms/step "
              f"(CPU {measured['cpu_w'] * 1e3:.1f} ms), server CPU {measured['per_byte'] * 1e9:.2f} ns per link "
              f"byte, from {measured['runs']} compute-bound run(s) in {measured['files']} runs file(s); "
              f"CPU per message: {describe_terms(terms) if terms else 'none fitted'}", flush=True)
        for r in rows:
            if r["status"] != "ok" or r["algorithm"] == COMPUTE_BOUND:
                continue
            topology, n, s = _modelled(r)
            cfg = algorithm_config(r["algorithm"], n, s, config, sets) if topology == "hosts" else None
            if cfg is None:
                why = ("the loopback topology (every role on one shared link; runs of earlier code and configs)"
                       if topology != "hosts" else "an algorithm key this checkout's bench_network does not know")
                skipped.setdefault((_show(path), why), set()).add(r["algorithm"])
                continue
            p = predict_row(r, cfg, dict(measured, terms=terms), overlap, args.cores)
            g = groups.setdefault(_key(path, r), dict(rows=[], predicted=[], in_sample=False))
            g["rows"].append(r)
            g["predicted"].append(p)
            g["in_sample"] |= _key(path, r) + (r["repeat"],) in in_sample or (own and p["lay"]["kind"] == "ssd")
    notes = [f"{path}: {', '.join(sorted(algs))}: {why}" for (path, why), algs in skipped.items()]
    return [_layout_row(k, g) for k, g in groups.items()], notes, every, _fits_note(fits, every)


def _fits_note(fits, every):
    """One line on the CPU-per-message terms: their range over the leave-one-file-out fits, and on all."""
    terms = [t for t, _ in fits.values() if t]
    if not terms:
        return "CPU per message: not fitted (no round-based run with its CPU measured)"
    span = {k: (min(t[k] for t in terms), max(t[k] for t in terms)) for k in terms[0]}
    scale = dict(server_per_worker=(1e3, " ms"), server_per_pair=(1e3, " ms"), worker_per_process=(100, "%"))
    ranges = ", ".join(f"{k} {lo * scale[k][0]:.2f}-{hi * scale[k][0]:.2f}{scale[k][1]}"
                       for k, (lo, hi) in span.items())
    return (f"CPU per message, fitted on the other runs files for each file (leave one file out): {ranges}; "
            f"fitted on all: {describe_terms(every)}")


def _layout_row(key, g):
    path, alg, n, s, rate = key
    med = statistics.median
    meas = med(_num(r["steady_images_per_sec"]) for r in g["rows"])
    pred = med(p["images_per_sec"] for p in g["predicted"])
    out = dict(runs=_show(path), algorithm=alg, workers=n, servers=s, rate_mbit=rate,
               repeats=len(g["rows"]), measured_images_per_sec=round(meas, 1),
               predicted_images_per_sec=round(pred, 1), error=round(pred / meas - 1, 4),
               limited_by=g["predicted"][0]["limit"], in_sample=g["in_sample"],
               downlink=g["predicted"][0]["lay"]["bytes"]["downlink"])
    for role, d in (("server", "tx"), ("server", "rx"), ("worker", "tx"), ("worker", "rx")):
        m = [_num(r.get(f"steady_{role}_{d}_bytes_per_step")) for r in g["rows"]]
        out[f"measured_{role}_{d}_kb"] = round(med(m) / 1e3, 1) if all(m) else "–"
        out[f"predicted_{role}_{d}_kb"] = round(g["predicted"][0][f"{role}_{d}"] / 1e3, 1)
    m = [_num(r.get("steady_server_cpu_seconds_per_step")) for r in g["rows"]]
    out["measured_server_cpu_ms"] = round(med(m) * 1e3, 2) if all(m) else "–"
    out["predicted_server_cpu_ms"] = round(med(p["server_cpu"] for p in g["predicted"]) * 1e3, 2)
    m = [p["images_per_sec_measured_cpu"] for p in g["predicted"]]
    out["error_with_measured_cpu"] = round(med(m) / meas - 1, 4) if all(m) else ""
    return out


# ------------------------------------------------------------------------------------- projection

# The shipped config chooses its density for the link (auto); the projections count the bytes of 1%.
ONE_PERCENT = "compression.density=0.01"
VARIANTS = (  # name -> (kind, overrides of the model's shipped SSD-SGD + top-k config)
    ("SSGD (PS)", "ssgd", [ONE_PERCENT, "algorithm.type=ssgd", "compression.type=none"]),
    ("SSD-SGD + top-k 1%, exact downlink", "ssd", [ONE_PERCENT, "compression.downlink=sparse"]),
    ("SSD-SGD + top-k 1%, compressed downlink", "ssd", [ONE_PERCENT, "compression.downlink=compressed"]),
    ("ring all-reduce", "ring", [ONE_PERCENT, "algorithm.type=ssgd", "compression.type=none"]),
)


def projection_config(model, sets, workers, servers):
    """The model's shipped config at the published batch (for N workers and S servers); with S > 1 one
    buffer per server (compression.buffers: one) where the plan allows it, so the load spreads."""
    pub = PUBLISHED[model]
    base = [*sets, f"train.batch_size={pub['batch']}"]     # N and S go to the byte accounting, not the config
    cfg = load(os.path.join(ROOT, pub["config"]), base)
    if servers > 1 and cfg.compression.buffers != "one":
        spread = load(os.path.join(ROOT, pub["config"]), [*base, "compression.buffers=one"])
        try:
            round_bytes(model_shapes(spread), spread, workers, servers)
            return spread
        except ModelError:
            pass
    return cfg


def project_point(model, workers, servers, gbit, overlap, terms=None):
    """Images/s and what limits, per variant, of one projected layout (terms: the servers' CPU per message)."""
    pub = PUBLISHED[model]
    measured = dict(t_c=pub["step_seconds"], cpu_w=pub["step_seconds"], per_byte=0.0, cores=None, latency=LATENCY,
                    terms=terms)
    out = dict(model=model, workers=workers, servers=servers, gbit=gbit,
               compute_bound=round(workers * pub["batch"] / pub["step_seconds"], 1))
    for name, kind, sets in VARIANTS:
        cfg = projection_config(model, sets, workers, servers)
        lay = layout(cfg, workers, servers, gbit * 1e9 / 8, measured, kind=kind)
        t, limit = step(lay, overlap)
        out[name] = round(workers * pub["batch"] / t, 1)
        out[f"{name}: limited by"] = limit
        if kind == "ssd":
            out[f"{name}: pull/push"] = round(lay["bytes"]["pull"] / lay["bytes"]["push"], 2)
            out[f"{name}: worker extra ms"] = round(lay["extra"] * 1e3, 1)
            out[f"{name}: server ms"] = round(lay["server"] * 1e3, 1)
            # what-if: the encode and the replica update off the step's critical path (not the code today)
            hidden = step(dict(lay, extra=0.0), overlap)[0]
            out[f"{name}: without worker CPU"] = round(workers * pub["batch"] / hidden, 1)
    return out


def project(overlap, terms=None):
    rows = []
    for model in PUBLISHED:
        for n in PROJECT_N:
            for s in (1, n):
                for gbit in PROJECT_GBIT:
                    print(f"projecting {model}, N = {n}, S = {s}, {gbit} Gbit/s", flush=True)
                    rows.append(project_point(model, n, s, gbit, overlap, terms))
    return rows


# ----------------------------------------------------------------------------------------- output

def _pct(x):
    return f"{x * 100:+.1f}%"


def validation_md(rows, skipped, note):
    lines = ["## Validation: predicted vs measured images/s (virtual cluster, per-host links)", "",
             f"Parameters: {note}. Everything else is measured separately (see the script's docstring).", "",
             "| runs | algorithm | N | S | link | repeats | measured img/s | predicted img/s | error | limited by "
             "| server tx KB/step meas./pred. | server rx KB/step meas./pred. | worker rx KB/step meas./pred. "
             "| server CPU ms/step (all servers) meas./pred. | error given the run's CPU | in-sample |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---|---|---|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['runs']} | {r['algorithm']} ({r['downlink']} downlink) | {r['workers']} | {r['servers']} "
                     f"| {rate_name(r['rate_mbit'])} | {r['repeats']} | {r['measured_images_per_sec']:.1f} "
                     f"| {r['predicted_images_per_sec']:.1f} | {_pct(r['error'])} | {r['limited_by']} "
                     f"| {r['measured_server_tx_kb']} / {r['predicted_server_tx_kb']} "
                     f"| {r['measured_server_rx_kb']} / {r['predicted_server_rx_kb']} "
                     f"| {r['measured_worker_rx_kb']} / {r['predicted_worker_rx_kb']} "
                     f"| {r['measured_server_cpu_ms']} / {r['predicted_server_cpu_ms']} "
                     f"| {_pct(r['error_with_measured_cpu']) if r['error_with_measured_cpu'] != '' else '–'} "
                     f"| {'yes' if r['in_sample'] else 'no'} |")
    worst = max((abs(r["error"]) for r in rows if not r["in_sample"]), default=None)
    worst = _pct(worst) if worst is not None else "none (no out-of-sample layout)"
    lines += ["", f"Largest out-of-sample error: {worst} (target: every layout within 20%).", "",
              "Error given the run's CPU: a diagnostic, not a prediction: the same model with the worker's and "
              "the servers' CPU per step that the run itself measured in place of the modelled ones (the lone "
              "worker's compute-bound CPU plus its encode and replica update; the servers' round, per value "
              "and per byte); where it is small and the error is not, the modelled CPU is what is missing."]
    if skipped:
        lines += ["", "Not modelled:"] + [f"- {s}" for s in skipped]
    return "\n".join(lines)


def projection_md(rows, note):
    names = [v[0] for v in VARIANTS]
    lines = ["## Projection (modelled, nothing here is measured)", "",
             "Compute of one worker step: published single-GPU step times:"]
    lines += [f"- {m}: {p['figure']} <{p['source']}>" for m, p in PUBLISHED.items()]
    lines += ["", f"Latency {LATENCY * 1e6:g} us per message (assumed); the hosts' network stacks are assumed to "
              f"keep up with the link; the servers' CPU per round and the SSD-SGD worker's encode and replica "
              f"update are this project's CPU measurements (results/bench_server, results/bench_selection), one "
              f"core each. {note}. Each cell: img/s (what limits the step: SSD-SGD's step is the largest of its terms; "
              f"SSGD and ring all-reduce add their communication to the compute, and the label names the larger "
              f"of the two). The servers are hosts of their own, on links of the same rate.", ""]
    for model in PUBLISHED:
        for policy, label in (("one", "S = 1 server"), ("n", "S = N servers (2N hosts; the ring uses N)")):
            sel = [r for r in rows if r["model"] == model and (r["servers"] == 1) == (policy == "one")]
            lines += [f"### {model}, {label}", "",
                      "| N | link | compute bound img/s | " + " | ".join(names) + " | best |",
                      "|---:|---|---:|" + "---:|" * len(names) + "---|"]
            for r in sel:
                best = max(names, key=lambda n: r[n])
                cells = [f"{r[n]:,.0f} ({r[n + ': limited by']})" for n in names]
                lines.append(f"| {r['workers']} | {r['gbit']} Gbit/s | {r['compute_bound']:,.0f} | "
                             + " | ".join(cells) + f" | {best} |")
            key = names[2] + ": without worker CPU"
            lines += ["", f"What-if, not the code today: with the worker's encode and replica update off the step's "
                          f"critical path, {names[2]} would give "
                      + ", ".join(f"{r[key]:,.0f}" for r in sel) + " img/s (the rows above, in order).", ""]
    return "\n".join(lines)


def write_outputs(out, validation, projection, args):
    out = results_folder(out)
    sections = []
    if validation is not None:
        rows, skipped, note = validation
        write_csv(os.path.join(out, "validation.csv"), rows)
        sections.append(validation_md(rows, skipped, note))
    if projection is not None:
        rows, note = projection
        write_csv(os.path.join(out, "projection.csv"), rows)
        sections.append(projection_md(rows, note))
    text = "# Cost model of the system (bench/scaling_model.py)\n\n" + "\n\n".join(sections)
    write_text(os.path.join(out, "table.md"), text)
    configs = sorted({os.path.join(ROOT, p["config"]) for p in PUBLISHED.values()} | set(args.configs_used))
    write_manifest(out, configs, inputs=[SERVER_FITS, SELECTION], published=PUBLISHED, latency_seconds=LATENCY,
                   frame=FRAME, mss=MSS, cores=args.cores, fit_on=_show(args.fit_on),
                   runs=[_show(r) for r in args.runs],
                   note="the machine was shared with other jobs while the inputs were measured; the model itself "
                        "runs no timing")
    print(text)
    print(f"\nwritten: {out}/table.md", flush=True)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("validate", "project", "all"))
    ap.add_argument("runs", nargs="*", help="runs.csv files of bench/bench_network.py (validate, all)")
    ap.add_argument("--out", default=os.path.join(ROOT, OUT))
    ap.add_argument("--fit-on", default=os.path.join(ROOT, FIT_ON), help="runs.csv whose SSGD runs fit `overlap`")
    ap.add_argument("--compute-bound", help="runs.csv with the compute_bound rows, if not in each runs file")
    ap.add_argument("--config", help="base config the benchmark ran with (default: from its manifest.json)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="overrides it ran with")
    ap.add_argument("--cores", type=int, default=2, help="cores of the machine the runs ran on (default 2)")
    args = ap.parse_args(argv)
    if args.mode != "project" and not args.runs:
        ap.error(f"{args.mode}: give at least one runs.csv")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        args.pool = pool_keys([*args.runs, args.fit_on], args)
    except (OSError, ValueError) as e:
        print(f"scaling_model: {e}", file=sys.stderr)
        return 2
    try:
        overlap, in_sample, note = fit_overlap(args.fit_on, args)
        validation = projection = None
        terms, terms_note = None, "no CPU per message (no runs given)"
        if args.runs:
            rows, skipped, terms, terms_note = validate(args.runs, args, overlap, in_sample)
            if not rows:
                raise ModelError(f"no run the model covers in {', '.join(args.runs)} ({'; '.join(skipped)})")
            validation = (rows, skipped, f"{note}; {terms_note}") if args.mode != "project" else None
        if args.mode in ("project", "all"):
            projection = (project(overlap, terms), f"{note}; {terms_note}")
    except ModelError as e:
        print(f"scaling_model: {e}", file=sys.stderr)
        return 2
    write_outputs(args.out, validation, projection, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

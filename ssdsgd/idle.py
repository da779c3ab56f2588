"""Which settings the rest of a config leaves without effect ("idle"): algorithm.delay when algorithm.type
is ssgd, compression.density without a sparsifier, a schedule's factor without milestones, ... The loader
names those given a value of their own in a `note:` line (config.Config.ignored) instead of ignoring them
silently, and a resume may change an idle key (ssdsgd.checkpoint), since it changes no step. A setting
that asks for what the rest of the config cannot do (an fp16 wire, a density warm-up or a sparse downlink
without a sparsifier, milestones on another schedule) is refused instead, by config.py's checks."""
from ssdsgd.compression.registry import NATIVE_2BIT, is_sparsifier, sparsifier_names
from ssdsgd.registry import ALGORITHMS, STOCK, runner
from ssdsgd.schema import RING_DOWNLINKS, ROOTED_DATASETS, SCHEMA, defaults, shown


def idle_keys(given, c):
    """{dotted key: None, or 'key = value has no effect: why' where it was given a value other than its
    default} for the keys that the rest of the resolved config `c` leaves unused; `given`: the config
    before config._resolve_auto. Noted, not refused: comparing SSGD with SSD-SGD is `--set
    algorithm.type=ssgd` on an SSD-SGD config, whose delay-stage settings then stand idle. The
    algorithm.* keys in use are those its registry entry declares (ssdsgd.registry)."""
    default_config = defaults(SCHEMA)

    def value_given(path):
        value, default = given, default_config
        for key in path:
            value, default = value[key], default[key]
        return value, value != default

    alg, comp, ck = c["algorithm"], c["compression"], c["checkpoint"]
    unused = {}                                            # key path -> why
    uses = ALGORITHMS[alg["type"]].uses
    for path in _algorithm_keys():
        if not _declared(uses, path):
            users = [name for name, a in ALGORITHMS.items() if _declared(a.uses, path)]
            unused[path] = f"algorithm.type is {alg['type']}, which does not use it" + \
                           (f" (used by {', '.join(users)})" if users else "")
    if "local" in uses:
        if alg["local"]["optimizer"] != "glu":
            unused[("algorithm", "local", "c")] = f"only glu uses it, and algorithm.local.optimizer is " \
                                                  f"{alg['local']['optimizer']}"
        if alg["local"]["lr"]:
            unused[("algorithm", "local", "lr_scale")] = "algorithm.local.lr is set, and sets the local rate"
    _idle_compression(comp, unused)
    if runner(alg["type"], comp["type"]).plan == STOCK:
        why = f"MXNet's stock KVStore runs algorithm.type {alg['type']} with compression.type {comp['type']}; " \
              f"only the round-based server plans buffers"
        unused.update({("compression", k): why for k in ("buffers", "buffer_bytes")})
    elif comp["buffers"] != "fixed":
        unused[("compression", "buffer_bytes")] = f"only buffers: fixed uses it, and compression.buffers is " \
                                                  f"{comp['buffers']}"
    if comp["type"] != NATIVE_2BIT:
        unused[("compression", "threshold")] = f"only compression.type 2bit uses it (type is {comp['type']})"
    _idle_data_and_schedule(c, unused)
    if not (ck["dir"] and ck["every_epochs"]):
        unused[("checkpoint", "keep")] = "no checkpoint is written (checkpoint.dir and checkpoint.every_epochs " \
                                         "are not both set)"
    idle = {}
    for path, why in unused.items():
        value, was_set = value_given(path)
        idle[".".join(path)] = f"{'.'.join(path)} = {shown(value)} has no effect: {why}" if was_set else None
    return idle


def _idle_compression(comp, unused):
    """The compression keys the section's type, density, allocation and downlink leave idle, into `unused`."""
    sparsifier = is_sparsifier(comp["type"])
    if not sparsifier:
        why = f"compression.type is {comp['type']}; only the sparsifiers ({sparsifier_names()}) use it"
        unused.update({("compression", k): why for k in (
            "density", "auto_slack", "error_feedback", "momentum_correction", "momentum_masking", "min_dense_bytes",
            "fusion", "allocation", "allocate_every", "downlink_check_every")})
    else:
        if comp["density"] != "auto":
            unused[("compression", "auto_slack")] = f"only density: auto uses it, and compression.density is " \
                                                    f"{shown(comp['density'])}"
        if comp["allocation"] != "gradient":
            unused[("compression", "allocate_every")] = f"only allocation: gradient re-allocates, and " \
                                                        f"compression.allocation is {comp['allocation']}"
        if comp["downlink"] not in RING_DOWNLINKS:
            unused[("compression", "downlink_check_every")] = f"only the sparse and compressed downlinks are " \
                                                              f"checked, and compression.downlink is {comp['downlink']}"


def _algorithm_keys():
    """The key paths of the algorithm section but its type: ("algorithm", "delay"), ("algorithm", "local", "c")."""
    section = SCHEMA["algorithm"]
    return [("algorithm", k, *sub) for k in section if k != "type"
            for sub in ([(s,) for s in section[k]] if isinstance(section[k], dict) else [()])]


def _declared(uses, path):
    """Whether an Algorithm's `uses` names the key path ("algorithm", "local", "c"): as "local" or "local.c"."""
    return path[1] in uses or ".".join(path[1:]) in uses


def _idle_data_and_schedule(c, unused):
    """The data and learning-rate schedule keys of idle_keys (key path -> why)."""
    d, sched = c["data"], c["train"]["lr_schedule"]
    dataset = f"data.dataset is {d['dataset']}"
    if d["dataset"] not in ROOTED_DATASETS:
        unused[("data", "root")] = f"{dataset}, which is not read from a folder"
    if d["dataset"] != "synthetic":
        unused[("data", "synthetic_samples")] = f"only the synthetic dataset uses it, and {dataset}"
    if d["dataset"] != "imagenet":
        unused[("data", "preprocess_threads")] = f"only ImageNet's RecordIO reader uses it, and {dataset}"
    if d["dataset"] in ("digits", "synthetic"):
        unused[("data", "augment")] = f"{dataset}, which has no augmentation"
    if not d["validation"]:
        unused[("data", "validation_from")] = "data.validation is 0: no validation split is drawn"
    kind = f"train.lr_schedule.type is {sched['type']}"
    epochs = c["train"]["epochs"]
    if sched["type"] != "step" or not any(m < epochs for m in sched["milestones"]):
        why = f"the step schedule's milestones use it, and {kind}" if sched["type"] != "step" else \
            f"no milestone falls before the end of the run (train.epochs {epochs})"
        unused[("train", "lr_schedule", "factor")] = why
        unused[("train", "lr_schedule", "milestones")] = why
    if sched["type"] != "poly":
        unused[("train", "lr_schedule", "power")] = f"only the poly schedule uses it, and {kind}"
    if sched["type"] not in ("cosine", "poly"):
        unused[("train", "lr_schedule", "final_lr")] = f"only the cosine and poly schedules end at it, and {kind}"

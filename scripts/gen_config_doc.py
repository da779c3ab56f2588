"""docs/config.md from ssdsgd.schema.SCHEMA: every key with its type, default, allowed values and doc.

    python scripts/gen_config_doc.py            # rewrite docs/config.md
    python scripts/gen_config_doc.py --check    # exit 1 if docs/config.md differs from SCHEMA

tests/unit/test_docs.py renders the file in memory and compares it with the committed one, so the reference
cannot drift from the code. Whether a key may change on `--resume` comes from ssdsgd.checkpoint.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.* and ssdsgd from this checkout
from scripts.results_io import check_or_write
from ssdsgd.checkpoint import RESUME_MAY_CHANGE, RESUME_MUST_MATCH
from ssdsgd.config import NAME_MAX, SCHEMA, ListField, StrListField
from ssdsgd.config_yaml import MAX_BYTES, MAX_DEPTH, MAX_VALUES

OUT = os.path.join(ROOT, "docs", "config.md")
COMMAND = "python scripts/gen_config_doc.py"

SECTION_TEXT = {
    "": "Top-level keys.",
    "cluster": "How many processes, where they run, and when a job counts as failed.",
    "data": "The data set and how it is read, cut down and split.",
    "model": "The network.",
    "train": "The global optimisation: epochs, batch, learning rate and its schedule, evaluation.",
    "algorithm": "How workers exchange gradients and weights: SSGD, ASGD or SSD-SGD and its settings.",
    "compression": "What a worker pushes (dense, 2-bit, or a sparsifier with error feedback) and how "
                   "workers refresh their weights.",
    "checkpoint": "Where and how often checkpoints are written.",
    "log": "Where run folders go and how often a step is logged.",
}

# Descriptions of the keys whose Field in SCHEMA has no doc string yet (tests/unit/test_docs.py checks that
# every key has exactly one of the two, so a doc added to SCHEMA must be removed here).
NOTES = {
    "seed": "seed of the initial weights and the data order (the order depends only on seed, epoch and rank)",
    "cluster.workers": "worker processes; each trains on its own shard of every epoch",
    "cluster.servers": "server processes; round-based runs place each fused buffer whole on one server",
    "cluster.launcher": "local: every process on this machine; ssh: servers and workers on the hosts of "
                        "cluster.hostfile, the scheduler on the launching machine",
    "cluster.hostfile": "ssh launcher: one host a line, `host[:sshport] [slots=N] [interface=IF] [python=PATH] "
                        "[gpus=IDS|N] [spare]` (configs/hosts.example; a spare gets no role until a host "
                        "holding roles does not answer ssh); required with launcher ssh, an error with local",
    "data.dataset": "digits: scikit-learn's bundled set; synthetic: random tensors for throughput runs; the "
                    "others are read from data.root (nothing is downloaded)",
    "data.root": "the folder holding the data set's files; required for cifar10, mnist, fashion_mnist, imagenet",
    "data.num_classes": "imagenet (null: 1000; a label outside 0 .. num_classes - 1 is refused) and synthetic "
                        "(null: 10); the other data sets have 10",
    "data.augment": "training augmentation: random crop and flip as each data set's recipe does",
    "data.preprocess_threads": "imagenet: decoding threads of MXNet's ImageRecordIter per worker",
    "model.name": "small_cnn, linear, mlp, or a gluoncv model zoo name (cifar_resnet20_v1, resnet50_v1, ...)",
    "model.hybridize": "train through MXNet's static graph; false trains imperatively (faster on some CPUs: "
                       "bench/bench_step.py tells); evaluation always runs a static graph",
    "train.epochs": "epochs to train",
    "train.momentum": "momentum of the global (server) update",
    "train.wd": "weight decay",
    "train.lr_schedule.type": "constant, step (x factor at each milestone), cosine or poly (to final_lr)",
    "train.lr_schedule.factor": "step schedule: multiplier at each milestone",
    "train.lr_schedule.power": "poly schedule: exponent",
    "train.lr_schedule.final_lr": "cosine and poly schedules: the learning rate they end at",
    "train.lr_schedule.warmup_epochs": "linear ramp from 0 to lr over this many epochs first",
    "train.eval_every_epochs": "evaluate the global weights every this many epochs (and after the last)",
    "algorithm.type": "ssgd: synchronous SGD (stock dist_sync); asgd: asynchronous SGD (stock dist_async); "
                      "ssd: SSD-SGD on the round server",
    "algorithm.strict": "issue every pull only once the round it asks for is applied, so every refresh carries "
                        "exactly that round (always so when max_staleness = delay)",
    "algorithm.local.lr": "local learning rate as a number (overrides lr_scale)",
    "compression.type": "none: dense pushes; 2bit: MXNet's native 2-bit compression (stock path only); or a "
                        "registered sparsifier (topk, randomk, dgc)",
    "compression.error_feedback": "add what was not sent to the next step's gradient",
    "compression.fp16_values": "sparsifiers: send values (and index digits) as float16, 6 bytes a value "
                               "instead of 8",
    "compression.fusion": "ahead: sparsify each tensor, then fuse the pieces (SAFusion); behind: fuse, then one "
                          "top-k per buffer",
    "compression.buffer_bytes": "buffers: fixed: at most this many bytes of parameters per buffer (a larger "
                                "tensor alone)",
    "checkpoint.dir": "folder of the checkpoints (epoch-<E>/); null: no checkpoints",
    "checkpoint.every_epochs": "checkpoint every this many epochs; 0: never",
    "log.dir": "run folders go to <log.dir>/<name>/<stamp>/",
    "log.every_steps": "a progress line and a metrics.jsonl record every this many steps",
}


def _fmt(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _type(field):
    if isinstance(field, StrListField):
        text = "list of strings"
    elif isinstance(field, ListField):
        text = f"list of {'numbers' if field.item is float else 'integers'}"
        if field.length is not None:
            text += f" ({field.length} values)"
    else:
        text = " or ".join([t.__name__ for t in field.types] + [f"`{k}`" for k in field.keywords])
    return text + (" or null" if field.nullable else "")


def _allowed(field):
    choices = field.choices() if callable(field.choices) else field.choices
    if choices is not None:
        return ", ".join(f"`{c}`" for c in choices)
    parts = []
    if field.min is not None:
        parts.append(f">= {_fmt(field.min)}")
    if field.gt is not None:
        parts.append(f"> {_fmt(field.gt)}")
    if field.max is not None:
        parts.append(f"<= {_fmt(field.max)}")
    if isinstance(field, ListField) and not isinstance(field, StrListField):
        parts.insert(0, "each > 0")
    return ", ".join(parts)


def _resume(path):
    """'may change' or 'must match' on --resume (a key is covered by itself or a section above it)."""
    def covered(names):
        return any(path == n or path.startswith(n + ".") for n in names)
    if covered(RESUME_MAY_CHANGE):
        return "may change"
    if covered(RESUME_MUST_MATCH):
        return "must match"
    return "unclassified"


def _cell(text):
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(schema, prefix):
    """(dotted path, field) for the leaves of one section, nested sections after the section's own keys
    in SCHEMA order."""
    for key, spec in schema.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(spec, dict):
            yield from _rows(spec, path)
        else:
            yield path, spec


def _table(schema, prefix):
    lines = ["| key | type | default | allowed | on `--resume` | description |",
             "|---|---|---|---|---|---|"]
    for path, field in _rows(schema, prefix):
        lines.append("| " + " | ".join([
            f"`{path}`", _cell(_type(field)), f"`{_cell(_fmt(field.default))}`", _cell(_allowed(field)),
            _resume(path), _cell(field.doc or NOTES.get(path, ""))]) + " |")
    return lines


def render():
    """The whole of docs/config.md as a string."""
    out = [
        "# Configuration reference",
        "",
        f"Generated from `SCHEMA` in `ssdsgd/schema.py` by `{COMMAND}`; do not edit by hand "
        "(`tests/unit/test_docs.py` fails when this file and the schema disagree).",
        "",
        "A config is a YAML file of these sections; a key left out takes its default. Override any key on the "
        "command line with `--set section.key=value` (the value is YAML: "
        "`--set train.lr_schedule.milestones=[80,120]`). "
        "An unknown key, a wrong type or a value outside its range stops the job before any process starts "
        "(exit 2, naming the key; a value it quotes is cut to a short excerpt). The reader has limits, each met "
        f"with one such line: a file of at most {MAX_BYTES >> 20} MiB, nested at most {MAX_DEPTH} levels, at most "
        f"{MAX_VALUES:,} values once YAML aliases are expanded (no value inside itself); the run `name` has no "
        f"control characters and at most {NAME_MAX} bytes. "
        "A key given a value that the rest of the config leaves without effect "
        "(`algorithm.delay` when `algorithm.type` is ssgd, `compression.density` without a sparsifier) is named "
        "in a `note:` line as the job starts (and in `--dry-run`'s output), and ignored; a resume may change it. "
        "A default of `null` or `auto` is resolved when the config is loaded (the "
        "description says to what), and the run folder's `config.yaml` holds the resolved values. "
        "\"On `--resume`\": whether a resumed run may use a different value than its checkpoint "
        "(`ssdsgd/checkpoint.py`); a key that must match and differs is refused, naming it.",
        "",
    ]
    top = {k: v for k, v in SCHEMA.items() if not isinstance(v, dict)}
    sections = [("", top)] + [(k, v) for k, v in SCHEMA.items() if isinstance(v, dict)]
    for name, schema in sections:
        out.append(f"## {'`' + name + '`' if name else 'top level'}")
        out.append("")
        if SECTION_TEXT.get(name):
            out.append(SECTION_TEXT[name])
            out.append("")
        out.extend(_table(schema, name))
        out.append("")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs from SCHEMA; write nothing")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    code = check_or_write(args.out, render(), args.check, f"{args.out} differs from SCHEMA; run {COMMAND}")
    if not args.check:
        print(f"wrote {args.out}")
    return code

if __name__ == "__main__":
    sys.exit(main())

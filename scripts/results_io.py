"""Small helpers the experiment scripts share: running one job and reading its summary, their input
and output files, names used in their tables, and their SIGTERM handling."""
import csv
import json
import os
import re
import signal
import subprocess
import sys

from ssdsgd import provenance
from ssdsgd.launch.children import die_with_parent, stdout_to_devnull
from ssdsgd.metrics import ACC_TAG, CONFIG_FILE, SUMMARY_FILE, final_acc, metrics_file, read_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPUTE_BOUND = "compute_bound"          # bench_network's algorithm key for the 1-worker, no-comm. run


def rate_name(rate):
    """A link rate in Mbit/s as the tables and plots print it (0 or None: no limit)."""
    return "unlimited" if not rate else f"{rate:g} Mbit/s"


def job_name(label, seed):
    """A run folder name for one seed of a table's variant."""
    return re.sub(r"[^A-Za-z0-9]+", "_", f"{label} s{seed}").strip("_")


def job_overrides(name, log_dir, sets=()):
    """The config overrides job_command gives a job, in its order (load_config(config, these) is the
    job's config)."""
    return [f"log.dir={log_dir}", f"name={name}", *sets]


def job_command(config, name, log_dir, sets=()):
    """`python -m ssdsgd` of one job called `name`; its run folder is a new one under log_dir/name
    (run_folder tells which)."""
    cmd = [sys.executable, "-m", "ssdsgd", "--config", config]
    for text in job_overrides(name, log_dir, sets):
        cmd += ["--set", text]
    return cmd


def printed_run_folder(output, cwd=ROOT):
    """The run folder a job's front end printed ('run folder: X'; a relative X is under the job's cwd), or
    None when it printed none (refused before it chose one)."""
    for line in (output or "").splitlines():
        if line.startswith("run folder: "):
            return os.path.join(cwd, line[len("run folder: "):].strip())
    return None


def run_folder(output, log_dir, name):
    """The run folder a job's front end printed, else log_dir/name/latest (the newest run of that name: a
    job still starting, or one refused before it chose a folder)."""
    return printed_run_folder(output) or os.path.join(log_dir, name, "latest")


RUN_STAMP = re.compile(r"^(\d{8}-\d{6})(?:-(\d+))?$")     # a run folder's name: YYYYmmdd-HHMMSS[-n]


def _newest_stamped(home):
    """The newest YYYYmmdd-HHMMSS[-n] sub-folder of home (-10 after -9), or None."""
    stamps = [(m.group(1), int(m.group(2) or 1), name) for name in os.listdir(home)
              if (m := RUN_STAMP.match(name)) and os.path.isdir(os.path.join(home, name))]
    return os.path.join(home, max(stamps)[2]) if stamps else None


def resolve_run_dir(path):
    """A run folder the user named: itself, or for log.dir/<name> (the folder of a name's runs) the run
    its `latest` link points at, else its newest stamped run folder. ValueError: one line saying what
    was expected."""
    if not os.path.isdir(path):
        raise ValueError(f"{path} {'is not a folder' if os.path.exists(path) else 'does not exist'}")
    if any(os.path.exists(os.path.join(path, f)) for f in (SUMMARY_FILE, CONFIG_FILE, metrics_file())):
        return path                       # a run folder, finished or not
    latest = os.path.join(path, "latest")
    if os.path.lexists(latest):
        if not os.path.isdir(latest):
            raise ValueError(f"{latest} points to {os.readlink(latest)!r}, which is not a folder")
        return os.path.realpath(latest)
    newest = _newest_stamped(path)
    if newest is None:
        raise ValueError(f"{path} is neither a run folder (no summary.json, config.yaml or metrics.jsonl) nor a "
                         f"folder of runs (no 'latest' link, no YYYYmmdd-HHMMSS run folder)")
    return newest


def run_captured(cmd, **kwargs):
    """Run a job command from the repository root with OMP_NUM_THREADS=1, its output captured; the job
    dies with the script (dies_with_script)."""
    return subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=dies_with_script(), **kwargs)


def signal_group(proc, signum):
    """Send signum to the process group a job command was started in (start_new_session), while the
    job is not yet reaped (its pid is then still the group's id)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass


def dies_with_script():
    """preexec_fn of a job a script starts: the job gets SIGTERM when the script dies, even by SIGKILL or a
    SIGTERM the script does not handle, so no job outlives the script that ran it."""
    return die_with_parent(os.getpid(), signal.SIGTERM)


def stop_group(proc, grace):
    """End a job started in its own process group: SIGTERM (our launcher then stops its roles), SIGKILL
    if it still runs after `grace` seconds; waits for it."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait()


def job_summary(proc, run_dir):
    """The summary of a finished job, or None (and the end of its output on stderr) if it failed."""
    if proc.returncode != 0:
        print(proc.stdout[-3000:], file=sys.stderr)
        return None
    return read_summary(run_dir)


def summary_row(s):
    """A job's figures for a table's CSV row, from its summary.json dict."""
    acc, eval_set = final_acc(s)
    return {"eval_set": eval_set, "final_acc": acc, "best_acc": s[f"best_{ACC_TAG[eval_set]}_acc"],
            "images_per_sec": s["images_per_sec"], "wall_seconds": s["wall_seconds"], "steps": s["steps"],
            "push_bytes_per_step": s["bytes_per_step"]["push"], "pull_bytes_per_step": s["bytes_per_step"]["pull"],
            "max_staleness": s["max_staleness"], "mean_staleness": s["mean_staleness"],
            # SSD-SGD's steps after its synchronous warm-up (None for the others): 0 means it ran as SSGD.
            "delay_stage_steps": s["after_warmup"]["steps"] if s["algorithm"] == "ssd" else None}


def read_jsonl(path):
    """Records of a metrics.jsonl ([] when the file is missing); lines that do not parse, such as a
    last line cut off by a killed job, are skipped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def read_csv(path, needed=()):
    """The rows of a CSV this project wrote (runs.csv, jobs.csv, evals.csv, ...) as dicts of strings;
    each reader converts the columns it uses. `needed`: columns whose absence is a ValueError naming
    the file and the column."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in needed if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column {missing[0]!r}")
        return list(reader)


def write_csv(path, rows):
    """One row per dict; the columns are every key any row has, sorted."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)


def results_folder(path):
    """The absolute path of a results folder, made if it does not exist yet."""
    out = os.path.abspath(path)
    os.makedirs(out, exist_ok=True)
    return out


MANIFEST = "manifest.json"      # how a results folder was made, written by the script that made it


def write_manifest(out, configs, **extra):
    """<out>/manifest.json: the command line, the configs (path and text), the commit (and whether the
    tree had uncommitted changes), the machine and the date; extra keys as given."""
    texts = {}
    for path in configs:
        with open(path) as f:
            texts[os.path.relpath(os.path.abspath(path), ROOT)] = f.read()
    command = [os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "", *sys.argv[1:]]
    manifest = provenance.record(command, out, configs=texts, **extra)
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def done_rows(path):
    """The successful rows of an earlier runs.csv (numbers back as numbers), for --keep-done."""
    rows = [r for r in read_csv(path) if r["rc"] == "0"]
    for r in rows:
        for k, v in r.items():
            try:
                r[k] = int(v) if k in ("rc", "seed", "steps") else float(v)
            except (TypeError, ValueError):
                pass
    return rows


def _read_manifest(out):
    """out's manifest.json as a dict, or None when there is none or it cannot be read as one."""
    try:
        with open(os.path.join(out, MANIFEST)) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return None
    return old if isinstance(old, dict) else None


def earlier_runs(out):
    """The invocations that made the jobs --keep-done keeps (from the folder's manifest, before this
    invocation replaces it): command, commit and date of each, oldest first."""
    old = _read_manifest(out)
    if old is None:
        return []
    return old.get("earlier", []) + [{k: old.get(k) for k in ("command", "commit", "date")}]


def settings_problem(out, settings):
    """--keep-done: why out's finished jobs cannot be kept beside jobs run with `settings` (a JSON-able
    value: the options every job gets), or None. The folder's manifest records the settings its jobs
    were made with; a folder written before it did is taken as it is."""
    old = (_read_manifest(out) or {}).get("settings")
    if old is None or old == settings:
        return None
    return (f"--keep-done: the finished jobs in {out} were made with {old}, this run's would be made with "
            f"{settings}: give the same options, or choose another --out")


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text + "\n")


class _StdoutThatMayClose:
    """sys.stdout that survives its reader going away (`script | head`): the first write that finds the
    pipe closed points fd 1 at /dev/null, and the script goes on (its job, and its results, with it)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self):
        stdout_to_devnull()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_closed_stdout():
    """For the scripts that run jobs: a closed stdout must not end the script halfway (its `finally`
    would stop the job it is running, and no table would be written)."""
    if not isinstance(sys.stdout, _StdoutThatMayClose):
        sys.stdout = _StdoutThatMayClose(sys.stdout)


def _stop(signum, frame):
    raise KeyboardInterrupt


def stop_on_sigterm():
    """Make SIGTERM unwind like Ctrl-C, so a running job is ended and its namespace deleted (a
    background `nohup` run ignores SIGINT; SIGTERM is how it gets stopped). Returns the previous
    handler, for callers that put it back."""
    return signal.signal(signal.SIGTERM, _stop)


def check_or_write(path, text, check, stale):
    """A generated file: with check, 0 if `path` holds `text`, else print `stale` and return 1 (writing
    nothing); without, write it and return 0."""
    if check:
        try:
            with open(path) as f:
                same = f.read() == text
        except OSError:
            same = False
        if not same:
            print(stale, file=sys.stderr)
        return 0 if same else 1
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return 0

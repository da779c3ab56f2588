"""MXNet's stock command lines, N times under MXNet's own launcher and under ours, side by side (issue 38).

    python scripts/stock_compat.py [--repeats 10] [--out results/stock_compat] [--cases sparse_step,...] [--load N]

Each case is one command line from MXNet's nightly KVStore tests or its launcher's documentation, run with
our own small scripts (tests/stock_scripts/) in a fresh working directory per run. A run passes when the
roles did what the script checks: every worker printed its `passed`/`profiled` line and the expected files
exist. The launcher's exit code is recorded too; stock's says little (its local tracker waits for the
scheduler only, so a failing worker still exits 0). Writes runs.csv (one row per run), table.md and
manifest.json to --out. --load N keeps N busy-loop processes running meanwhile (a machine as loaded
as a whole `make test` on 2 cores), for failures that show only under load. Slow (tens of minutes):
not part of `make test`; tests/test_stock_compat.py runs each case once.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.* from this checkout
from scripts.results_io import write_csv, write_manifest, write_text

SCRIPTS = os.path.join(ROOT, "tests", "stock_scripts")
LAUNCHERS = {"stock": os.path.join(SCRIPTS, "stock_launch.py"), "ours": os.path.join(ROOT, "launch", "launch.py")}
PROFILES = ["rank0_server_profile.json", "rank0_worker_profile.json", "rank1_worker_profile.json"]


def _files_ok(cwd, names):
    """True when every file exists and holds JSON."""
    try:
        for name in names:
            with open(os.path.join(cwd, name)) as f:
                json.load(f)
    except (OSError, ValueError):
        return False
    return True


def _roles(cwd):
    return sorted(json.load(open(p))["DMLC_ROLE"] for p in glob.glob(os.path.join(cwd, "role.*.json")))


def _every_worker_passed(workers):
    ranks = [str(r) for r in range(workers)]
    return lambda out, cwd: sorted(re.findall(r"rank (\d+) sparse step passed", out)) == ranks


# name: (launcher arguments, does the run pass? (output, working directory) -> bool)
CASES = {
    "sparse_step": (["-n", "2", "python", os.path.join(SCRIPTS, "sparse_step.py")], _every_worker_passed(2)),
    "sparse_step_n4": (["-n", "4", "python", os.path.join(SCRIPTS, "sparse_step.py")], _every_worker_passed(4)),
    "profiling": (["-n", "2", "-s", "1", "python", os.path.join(SCRIPTS, "profile_roles.py")],
                  lambda out, cwd: len(re.findall(r"rank \d profiled", out)) == 2 and _files_ok(cwd, PROFILES)),
    "profiling_in_run": (["-n", "2", "-s", "1", "python", os.path.join(SCRIPTS, "profile_roles.py"), "--check-in-run"],
                         lambda out, cwd: len(re.findall(r"rank \d profiled", out)) == 2),
    "inline_assignment": (["-n", "1", "-s", "1", "FOO=inline", "python", "role_env.py"],
                          lambda out, cwd: _roles(cwd) == ["scheduler", "server", "worker"]
                          and len(re.findall(r"role \w+ foo inline", out)) == 3),
    "script_in_cwd": (["-n", "1", "-s", "1", "runme.sh"],
                      lambda out, cwd: _roles(cwd) == ["scheduler", "server", "worker"]),
}


# Fails under both launchers whatever the load (rank 0's own profile is written when it exits): a few runs show it.
FEW = {"profiling_in_run": 3}


def run_once(launcher, case, timeout):
    """One run in a fresh working directory: {launcher, case, exit, seconds, passed}."""
    args, check = CASES[case]
    cwd = tempfile.mkdtemp(prefix="stock_compat_")
    for name in ("role_env.py", "runme.sh"):
        shutil.copy2(os.path.join(SCRIPTS, name), cwd)
    if launcher == "stock":
        args = ["--launcher", "local", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, LAUNCHERS[launcher], *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # stock leaves its roles running when it exits early
        except ProcessLookupError:
            pass
        if code == "timeout":
            out, _ = proc.communicate()   # what the hung run printed, for its row
        proc.wait()
    time.sleep(1.0)   # roles killed above write their files (if any) no more
    out = out or ""
    row = {"launcher": launcher, "case": case, "exit": code, "seconds": round(time.monotonic() - t0, 1),
           "passed": bool(check(out, cwd))}
    if not row["passed"]:
        row["tail"] = " | ".join(out.strip().splitlines()[-3:])[-300:]
    shutil.rmtree(cwd, ignore_errors=True)
    return row


def start_load(count):
    """count busy-loop processes (each its own process group, ended by stop_load)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(count)]


def stop_load(procs):
    for proc in procs:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def table(rows, cases):
    lines = ["| case | launcher | passed | exit codes | seconds (median) |", "|---|---|---|---|---|"]
    for case in cases:
        for launcher in LAUNCHERS:
            mine = [r for r in rows if r["case"] == case and r["launcher"] == launcher]
            if not mine:
                continue
            codes = sorted({str(r["exit"]) for r in mine})
            seconds = sorted(r["seconds"] for r in mine)[len(mine) // 2]
            lines.append(f"| {case} | {launcher} | {sum(r['passed'] for r in mine)} of {len(mine)} | "
                         f"{', '.join(codes)} | {seconds:g} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cases", default=",".join(c for c in CASES if c != "sparse_step_n4"),
                    help=f"comma-separated, of: {', '.join(CASES)} (default: all but sparse_step_n4)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "stock_compat"))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--load", type=int, default=0, help="busy-loop processes kept running meanwhile")
    args = ap.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"stock_compat.py: unknown case(s) {', '.join(unknown)} (known: {', '.join(CASES)})")
    os.makedirs(args.out, exist_ok=True)
    rows, load = [], start_load(args.load)
    try:
        for case in cases:
            for _ in range(min(args.repeats, FEW.get(case, args.repeats))):
                for launcher in LAUNCHERS:   # alternate, so both see the same load over time
                    rows.append(run_once(launcher, case, args.timeout))
                    print(json.dumps(rows[-1]), flush=True)
                    write_csv(os.path.join(args.out, "runs.csv"), rows)
    finally:
        stop_load(load)
    write_text(os.path.join(args.out, "table.md"), table(rows, cases))
    write_manifest(args.out, [], repeats=args.repeats, cases=cases, busy_loops=args.load,
                   load_average=os.getloadavg())
    print(table(rows, cases))


if __name__ == "__main__":
    main()

"""Network-namespace helpers for the tests and the bandwidth-limited benchmarks (root only; needs `ip` and `tc`).

A `Namespace` is a fresh, uniquely named network namespace whose only interface is its own loopback:
    lo up with mtu 9000, and optionally `tbf rate <R>mbit burst 256kb latency 50ms` as its root qdisc
    (rate None = unlimited: no qdisc), optionally below a `netem delay <X>ms` root qdisc.
Every process started through `ns.argv([...])` (`ip netns exec NS ...`) sees only that loopback, so
all of a job's traffic crosses the shaped link, and the namespace's lo counters count every byte
(once as tx and once as rx, since loopback transmits to itself).

    with Namespace(rate_mbit=20) as ns:
        before = ns.counters()
        subprocess.run(ns.argv([sys.executable, "-m", "ssdsgd", ...]))
        sent = ns.counters()["tx_bytes"] - before["tx_bytes"]

The namespace is deleted on exit, also after an exception or Ctrl-C; processes still inside it
(which can only be ones we started in it) are killed by PID first.
"""
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time

PREFIX = "ssdsgd-bench-"
NETNS_DIR = "/run/netns"


class NetnsError(RuntimeError):
    """A namespace could not be created, shaped, read or deleted; the message says why."""


def check_tools():
    """Raise NetnsError unless we are root and `ip` and `tc` are on PATH."""
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root (run as root, e.g. with sudo)")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise NetnsError(f"missing tool(s): {', '.join(missing)} (install iproute2)")


def tools_problem():
    """What check_tools() says is missing here (as text), or None when namespaces can be made."""
    try:
        check_tools()
    except NetnsError as e:
        return str(e)
    return None


@contextlib.contextmanager
def signals_ignored():
    """A second Ctrl-C (or a SIGTERM) must not interrupt a teardown and leave namespaces behind
    (SIGINT and SIGTERM ignored meanwhile; signal handlers can only be set in the main thread)."""
    main = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in stops} if main else {}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _run(argv, what):
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise NetnsError(f"{what} failed: `{' '.join(argv)}`: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def unique_name(prefix=PREFIX):
    return f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"


def parse_net_dev_all(text):
    """Counters of every interface in /proc/<pid>/net/dev text: {iface: {rx_bytes, ..., tx_bytes, ...}}."""
    rx = ("rx_bytes", "rx_packets", "rx_errors", "rx_dropped")
    tx = ("tx_bytes", "tx_packets", "tx_errors", "tx_dropped")
    out = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep or "|" in line:            # the two header lines
            continue
        v = [int(x) for x in rest.split()]
        if len(v) >= 12:
            out[name.strip()] = {**dict(zip(rx, v[0:4])), **dict(zip(tx, v[8:12]))}
    return out


def parse_net_dev(text, iface="lo"):
    """Counters of `iface` from /proc/<pid>/net/dev text: {rx_bytes, rx_packets, ..., tx_bytes, ...}."""
    found = parse_net_dev_all(text).get(iface)
    if found is None:
        raise NetnsError(f"interface {iface} not found in net/dev")
    return found


def counters_of_pid(pid, iface="lo"):
    """`iface` counters of the network namespace process `pid` lives in (no fork: reads /proc/<pid>/net/dev).

    Returns None when the process is gone."""
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            return parse_net_dev(f.read(), iface)
    except (FileNotFoundError, ProcessLookupError, NetnsError):
        return None


class Namespace:
    """A fresh network namespace with a shaped loopback. Context manager; see the module docstring."""

    def __init__(self, rate_mbit=None, delay_ms=None, *, burst="256kb", latency="50ms", mtu=9000,
                 prefix=PREFIX, name=None):
        if rate_mbit is not None and rate_mbit <= 0:
            rate_mbit = None                       # 0 means unlimited, as on the command line
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms or None
        self.burst, self.latency, self.mtu = burst, latency, mtu
        self.name = name or unique_name(prefix)
        self.created = False

    # ---- life cycle ---------------------------------------------------------------------------
    def create(self):
        check_tools()
        _run(["ip", "netns", "add", self.name], "creating the namespace")
        self.created = True
        try:
            _run(["ip", "-n", self.name, "link", "set", "lo", "mtu", str(self.mtu), "up"], "bringing lo up")
            self._shape()
        except BaseException:
            self.delete()
            raise
        return self

    def _shape(self):
        tc = ["tc", "-n", self.name, "qdisc", "add", "dev", "lo"]
        tbf = ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", self.burst, "latency", self.latency] \
            if self.rate_mbit else []
        if self.delay_ms:
            try:
                _run(tc + ["root", "handle", "1:", "netem", "delay", f"{self.delay_ms:g}ms"], "adding netem")
            except NetnsError as e:
                raise NetnsError(f"{e} (is the sch_netem kernel module available?)") from None
            if self.rate_mbit:
                _run(tc + ["parent", "1:1", "handle", "10:"] + tbf, "adding tbf below netem")
        elif self.rate_mbit:
            _run(tc + ["root", "handle", "1:"] + tbf, "adding tbf")

    def exists(self):
        return os.path.exists(os.path.join(NETNS_DIR, self.name))

    def delete(self):
        """Kill what is left inside (by PID), then delete the namespace. Idempotent."""
        if not self.created:
            return
        self.kill_all()
        if self.exists():
            proc = subprocess.run(["ip", "netns", "del", self.name], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0 and self.exists():
                raise NetnsError(f"cannot delete namespace {self.name}: {proc.stderr.strip()}")
        self.created = False

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        with signals_ignored():
            self.delete()
        return False

    # ---- use ----------------------------------------------------------------------------------
    def argv(self, command):
        """The argv running `command` inside the namespace."""
        return ["ip", "netns", "exec", self.name] + list(command)

    def pids(self):
        """PIDs of the processes inside the namespace (what `ip netns pids` prints), without a fork."""
        return pids_in(self.name)

    def kill_all(self, grace=3.0):
        """SIGTERM, then SIGKILL, every process still inside the namespace; returns the survivors."""
        return kill_pids(self.pids(), grace)

    def counters(self, iface="lo"):
        """Exact byte/packet counters of the namespace's lo: {tx_bytes, rx_bytes, tx_packets, ...}."""
        out = _run(["ip", "-n", self.name, "-s", "-j", "link", "show", iface], "reading counters")
        stats = json.loads(out)[0]["stats64"]
        return {f"{d}_{k}": v for d in ("rx", "tx") for k, v in stats[d].items()}

    def qdisc(self):
        return _run(["tc", "-n", self.name, "qdisc", "show", "dev", "lo"], "reading qdisc").strip()


def _alive(pid):
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_in(name):
    """PIDs of the processes living in network namespace `name` (matched by its inode), without a fork."""
    try:
        ino = os.stat(os.path.join(NETNS_DIR, name)).st_ino
    except FileNotFoundError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == ino:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def kill_pids(pids, grace=3.0):
    """SIGTERM, then SIGKILL after `grace` seconds, the given PIDs; returns those still alive."""
    pids = [p for p in pids if _alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            break
    return pids


def read_status_kb(pid, field="VmHWM"):
    """A `kB` field of /proc/<pid>/status (VmHWM = peak resident set size), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def read_environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Show that a shaped namespace can be created (and is deleted).")
    ap.add_argument("--rate", type=float, default=None, help="Mbit/s (default unlimited)")
    ap.add_argument("--delay", type=float, default=None, help="netem delay, ms")
    args = ap.parse_args()
    with Namespace(args.rate, args.delay) as ns:
        print(f"{ns.name}: {ns.qdisc()}")
        print(ns.counters())
    print(f"{ns.name} deleted: {not ns.exists()}")

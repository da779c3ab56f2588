"""A virtual cluster on one machine for multi-host tests and benchmarks (root only; iproute2, openssh).

    with VCluster(hosts=4, rate_mbit=None) as vc:
        subprocess.run(vc.exec_argv(0, ["python", "launch/launch.py", "--launcher", "ssh",
                                        "-H", vc.write_hostfile(path, [1, 2, 3]), "--ssh-config",
                                        vc.ssh_config, "--interface", "eth0", ...]))
        assert vc.leftovers() == {}

Layout: a "switch" namespace holding bridge `br0`; per host a namespace `<name>-h<i>` with a veth pair
(host end `eth0` with SUBNET.<i+1>/24, switch end `v<i>` enslaved to the bridge) and `lo` up. The
addresses exist only inside these namespaces, so nothing leaves the machine. Each host runs its own
sshd (own config, host key, PidFile, ListenAddress; key-only root login) accepting the cluster's job
key; `ssh -F vc.ssh_config h<i>` reaches host i from any host. The file system is shared (same mount
namespace), as a cluster with a shared run folder would have it. `rate_mbit` puts a tbf on both
directions of every host link: on the host's eth0 (egress) and on the switch end of its veth (ingress).
This kernel has no netem, so tbf is the only shaping.

Teardown (`delete`, also from `with` and atexit) kills each sshd (our child, so also reaped), then
every process left in each namespace by PID, deletes the namespaces and the key folder. `create`
first removes leftovers of earlier runs whose creating process is dead (their names carry its PID).
"""
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: testbed.* and ssdsgd from this checkout
from testbed import netns  # the namespace helpers live there; one home for each

PREFIX = "ssdsgd-vc-"
SUBNET = "10.231.0"          # private; exists only inside the cluster's namespaces
SSHD = "/usr/sbin/sshd"
TMP = tempfile.gettempdir()


class ClusterError(netns.NetnsError):
    """The cluster cannot be built here (the message says why); tests skip with it."""


def check_tools():
    """Raise ClusterError unless namespaces and sshd can be had on this machine."""
    try:
        netns.check_tools()
    except netns.NetnsError as e:
        raise ClusterError(str(e)) from None
    missing = [t for t in (SSHD, "ssh", "ssh-keygen") if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"missing {', '.join(missing)} (apt-get install openssh-server openssh-client)")


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def cleanup_leftovers(prefix=PREFIX):
    """Delete namespaces and key folders of clusters whose creating process is gone; returns their names."""
    removed = []
    names = os.listdir(netns.NETNS_DIR) if os.path.isdir(netns.NETNS_DIR) else []
    dirs = [d for d in os.listdir(TMP) if d.startswith(prefix)]
    for name in names + dirs:
        m = re.match(re.escape(prefix) + r"(\d+)-", name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(TMP, name)
        if name in dirs:
            shutil.rmtree(path, ignore_errors=True)
        else:
            netns.kill_pids(netns.pids_in(name))
            subprocess.run(["ip", "netns", "del", name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        removed.append(name)
    return removed


def _run(argv, what):
    try:
        return netns._run(argv, what)
    except netns.NetnsError as e:
        raise ClusterError(str(e)) from None


class VCluster:
    """N hosts with sshd on a bridge; see the module docstring."""

    def __init__(self, hosts=4, rate_mbit=None, *, burst="256kb", latency="50ms", prefix=PREFIX):
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1..200, got {hosts}")
        self.n = hosts
        self.rate_mbit = rate_mbit or None
        self.burst, self.latency = burst, latency
        self.name = netns.unique_name(prefix)
        self.switch = f"{self.name}-sw"
        self.namespaces = [f"{self.name}-h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.hostnames = [f"h{i}" for i in range(hosts)]
        self.dir = None
        self._made = []      # namespaces created so far, deleted in reverse
        self._sshd_pidfiles = []
        self._sshd = []      # Popen of each sshd

    # ---- life cycle ---------------------------------------------------------------------------
    def create(self):
        check_tools()
        cleanup_leftovers()
        atexit.register(self.delete)   # a crash or Ctrl-C in the middle must not leave namespaces behind
        try:
            self.dir = tempfile.mkdtemp(prefix=self.name + "-", dir=TMP)
            self._network()
            self._keys()
            for i in range(self.n):
                self._start_sshd(i)
            self._wait_for_sshd()
        except BaseException:
            self.delete()
            raise
        return self

    def _add_ns(self, name):
        _run(["ip", "netns", "add", name], f"creating namespace {name}")
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"], "bringing lo up")

    def _network(self):
        self._add_ns(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"], "creating the bridge")
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"], "bringing the bridge up")
        for i, ns in enumerate(self.namespaces):
            self._add_ns(ns)
            _run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}",
                  "netns", self.switch], "creating a veth pair")
            _run(["ip", "-n", self.switch, "link", "set", f"v{i}", "master", "br0", "up"], "plugging a veth")
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0"], "adding an address")
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"], "bringing eth0 up")
        if self.rate_mbit:
            self.shape(self.rate_mbit)

    def shape(self, rate_mbit):
        """Every host link at rate_mbit Mbit/s each way (tbf on the host's eth0 and on its switch end), or
        unshaped for None or 0; replaces the links' shaping, so a cluster can be reused at another rate."""
        was, self.rate_mbit = self.rate_mbit, rate_mbit or None
        for i, ns in enumerate(self.namespaces):
            for where, dev in ((ns, "eth0"), (self.switch, f"v{i}")):
                if was and not self.rate_mbit:
                    _run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], "removing the shaping")
                elif self.rate_mbit:
                    tbf = ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", self.burst, "latency", self.latency]
                    _run(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root"] + tbf, "shaping a link")

    def _keys(self):
        self.key = os.path.join(self.dir, "job_key")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.name, "-f", self.key], "making the job key")
        shutil.copy(self.key + ".pub", os.path.join(self.dir, "authorized_keys"))
        self.ssh_config = os.path.join(self.dir, "ssh_config")
        lines = []
        for host, addr in zip(self.hostnames, self.addresses):
            lines += [f"Host {host}", f"  HostName {addr}"]
        lines += ["Host *", "  User root", f"  IdentityFile {self.key}", "  IdentitiesOnly yes",
                  "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null", "  LogLevel ERROR",
                  "  BatchMode yes", "  ConnectTimeout 5"]
        with open(self.ssh_config, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _start_sshd(self, i):
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # sshd's privilege-separation directory
        hostkey = os.path.join(self.dir, f"host_key_h{i}")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", hostkey], "making a host key")
        pidfile = os.path.join(self.dir, f"sshd_h{i}.pid")
        config = os.path.join(self.dir, f"sshd_h{i}.conf")
        with open(config, "w") as f:
            f.write("\n".join([
                f"ListenAddress {self.addresses[i]}", "Port 22", f"HostKey {hostkey}", f"PidFile {pidfile}",
                f"AuthorizedKeysFile {os.path.join(self.dir, 'authorized_keys')}",
                "PermitRootLogin prohibit-password", "PubkeyAuthentication yes", "PasswordAuthentication no",
                "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PrintMotd no",
                "MaxStartups 100", "MaxSessions 100", "LogLevel ERROR"]) + "\n")
        self._sshd_pidfiles.append(pidfile)
        # -D: sshd stays our child, so we reap it; its log goes next to its config.
        with open(os.path.join(self.dir, f"sshd_h{i}.log"), "wb") as log:
            self._sshd.append(subprocess.Popen(self.exec_argv(i, [SSHD, "-D", "-e", "-f", config]),
                                               stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                               start_new_session=True))

    def _wait_for_sshd(self, seconds=15):
        deadline = time.monotonic() + seconds
        for i in range(self.n):
            while True:
                if self._sshd[i].poll() is not None:
                    with open(os.path.join(self.dir, f"sshd_h{i}.log")) as f:
                        raise ClusterError(f"sshd on h{i} exited: {f.read().strip()}")
                probe = subprocess.run(self.exec_argv(0, self.ssh_argv(i, "true")), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, timeout=seconds)
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise ClusterError(f"sshd on h{i} does not accept the job key: {probe.stdout.strip()}")
                time.sleep(0.1)

    def delete(self):
        """Kill every sshd and process in the cluster, delete its namespaces and keys. Idempotent."""
        netns.kill_pids([p.pid for p in self._sshd])   # `ip netns exec` execs sshd: same PID as its PidFile
        for p in self._sshd:
            p.wait()
        self._sshd, self._sshd_pidfiles = [], []
        left = []
        for ns in reversed(self._made):
            netns.kill_pids(netns.pids_in(ns))
            proc = subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            if proc.returncode != 0 and os.path.exists(os.path.join(netns.NETNS_DIR, ns)):
                left.append(f"{ns}: {proc.stdout.strip()}")
        self._made = []
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        atexit.unregister(self.delete)
        if left:
            raise ClusterError("cannot delete " + "; ".join(left))

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.delete()
        return False

    # ---- use ----------------------------------------------------------------------------------
    def exec_argv(self, i, command):
        """argv running `command` on host i (inside its namespace)."""
        return ["ip", "netns", "exec", self.namespaces[i]] + list(command)

    def ssh_argv(self, i, remote_command):
        """argv of an ssh client (to be run on some host) that runs `remote_command` on host i."""
        return ["ssh", "-F", self.ssh_config, self.hostnames[i], remote_command]

    def write_hostfile(self, path, hosts, extra=""):
        """A launcher host file listing the given host indices (`extra` appended to every line)."""
        with open(path, "w") as f:
            f.write("".join(f"{self.hostnames[i]}{extra}\n" for i in hosts))
        return str(path)

    def pids(self, i):
        return netns.pids_in(self.namespaces[i])

    def host_pid(self, i):
        """PID of a process that lives on host i for the cluster's whole life (its sshd): its
        /proc/<pid>/net/dev holds the host's interface counters, readable without a fork."""
        return self._sshd[i].pid

    def counters(self, i, iface="eth0"):
        """Exact byte/packet counters of host i's `iface`: {tx_bytes, rx_bytes, tx_packets, ...}."""
        out = _run(["ip", "-n", self.namespaces[i], "-s", "-j", "link", "show", iface], "reading counters")
        stats = json.loads(out)[0]["stats64"]
        return {f"{d}_{k}": v for d in ("rx", "tx") for k, v in stats[d].items()}

    def qdisc_drops(self):
        """Packets dropped by the shaping qdiscs of every host link, both directions (0 when unshaped)."""
        total = 0
        for ns, dev in [(ns, "eth0") for ns in self.namespaces] + [(self.switch, f"v{i}") for i in range(self.n)]:
            out = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
            try:
                total += sum(q.get("drops", 0) for q in json.loads(out or "[]") if q.get("kind") == "tbf")
            except ValueError:
                return None
        return total

    def leftovers(self):
        """{host: [cmdline, ...]} of processes on the hosts other than their sshd listeners."""
        sshd = {p.pid for p in self._sshd}
        found = {}
        for i in range(self.n):
            for pid in self.pids(i):
                if pid in sshd or not netns._alive(pid):
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    continue
                found.setdefault(self.hostnames[i], []).append(f"{pid}: {cmd}")
        return found


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Build a virtual cluster, show it works, tear it down.")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", type=float, default=None, help="Mbit/s per host link and direction")
    ap.add_argument("--cleanup", action="store_true", help="only remove leftovers of crashed runs")
    args = ap.parse_args()
    if args.cleanup:
        print("removed:", cleanup_leftovers() or "nothing")
        sys.exit(0)
    with VCluster(args.hosts, args.rate) as vc:
        for i in range(vc.n):
            out = subprocess.run(vc.exec_argv(0, vc.ssh_argv(i, "hostname -I")), stdout=subprocess.PIPE,
                                 text=True, timeout=20).stdout.strip()
            print(f"h{i}: {vc.namespaces[i]} {out}")
    print("deleted:", not any(os.path.exists(os.path.join(netns.NETNS_DIR, n)) for n in vc.namespaces))

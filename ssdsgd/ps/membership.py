"""Every worker and server proves that it belongs to the job (knows the job secret) before training.

ps-lite admits any process that reaches the scheduler's port with the job's DMLC_* settings and gives it
a rank; our signed commands refuse what it sends, but the job would still wait on it. So, once the
KVStore exists and before anything else, every worker runs a roll call (one round trip per step):
  1. it sends every server a signed `hello` command with its rank and a fresh nonce; each server
     checks the signature and keeps, for that rank, tag(secret, server rank, worker rank, nonce);
  2. kv.init and one push of each server's proof key (a small key placed on that server): the push
     reaches our updater, which writes the tags of every rank that said hello into the key;
  3. it pulls each proof key and checks its own tag: the server at that rank knows the secret.
A server that has not heard a valid hello from every worker rank within HELLO_TIMEOUT ends the job
naming the missing rank. The clock starts at the first hello (and runs at least HELLO_TIMEOUT from it),
or earlier, when the server sees that ps-lite's start-up is over: ps-lite waits for every node to
register, then every admitted worker opens a connection to every server, so once a server has accepted
one from the scheduler and one per worker rank (its own sockets in /proc/self/net), every admitted
worker can say hello. That is what ends a job whose every worker rank a stranger holds (no hello ever
comes; the excluded workers wait inside ps-lite's start-up) at once instead of at the stall timeout.
A worker whose roll call is not done within WORKER_TIMEOUT (longer, so that a server, which knows which
rank is missing, speaks first) ends it naming what it waited for.
ps-lite does not expose a peer's address to MXNet (nor MXNet to Python): messages name ranks only. So
each worker's hello lists its own connections' local addresses, and the server names the hosts of the
connections it accepted that no hello lists (less one from the scheduler's host): the stranger's.
"""
import hashlib
import hmac
import os
import secrets
import socket
import sys
import threading
import time

import numpy as np

from ssdsgd.env import NUM_WORKER_ENV, ROLE_NAME_ENV, SCHEDULER_HOST_ENV, SECRET_ENV
from ssdsgd.ps import commands
from ssdsgd.ps.keys import KeyAllocator

# Seconds from the first worker's signed hello to the last one's: all roles leave ps-lite's start-up
# together and a worker says hello at once (all within 0.1-0.3 s on a loaded 2-core machine).
HELLO_TIMEOUT = 5.0
WORKER_TIMEOUT = 2 * HELLO_TIMEOUT
PROOF_BASE_KEY = (1 << 20) + 16  # far above any plan key, past the probe and tally keys
TAG_PIECES = 8                 # a 128-bit tag as 16-bit pieces, each exact in a float32
PRIVATE_NETWORK = "keep the job's ports on a private network (README: A private network)"


def proof_keys(num_servers):
    """Server rank -> its proof key (MXNet's key hash puts each key on that server)."""
    keys = KeyAllocator(num_servers, start=PROOF_BASE_KEY)
    return [keys.on(r) for r in range(num_servers)]


def _address(hex_address):
    """'0100007F:1F90' (/proc/net/tcp, little-endian words) -> '127.0.0.1:8080'; IPv6 in brackets."""
    host, port = hex_address.split(":")
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff" * 2:          # IPv4 mapped into IPv6
        raw = raw[12:]
    ip = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)
    return f"{ip}:{int(port, 16)}" if len(raw) == 4 else f"[{ip}]:{int(port, 16)}"


def own_sockets():
    """This process's TCP sockets as (state, local address, remote address), state '0A' listening and
    '01' established (Linux /proc; [] elsewhere)."""
    inodes = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue                   # closed since the listing
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{table}") as f:
                rows = [line.split() for line in list(f)[1:]]
        except OSError:
            continue
        found += [(cols[3], _address(cols[1]), _address(cols[2])) for cols in rows if cols[9] in inodes]
    return found


def connected_from(sockets):
    """The remote addresses of the connections this process accepted (on a port it listens on), less
    its connections to itself."""
    listening = {local.rpartition(":")[2] for state, local, _ in sockets if state == "0A"}
    mine = {local for _, local, _ in sockets}
    return sorted(remote for state, local, remote in sockets
                  if state == "01" and local.rpartition(":")[2] in listening and remote not in mine)


def tag(secret, server, worker, nonce):
    """What server rank `server` answers to worker rank `worker`'s hello: float32 pieces of an HMAC."""
    mac = hmac.new(secret.encode(), f"ssdsgd-proof:{server}:{worker}:{nonce}".encode(), hashlib.sha256).digest()
    return np.frombuffer(mac[:2 * TAG_PIECES], dtype=">u2").astype(np.float32)


def _fail(text):
    """One line naming this role and host, then exit at once (ps-lite's finalize would wait forever)."""
    name = os.environ.get(ROLE_NAME_ENV, "process")
    print(f"{name} on {socket.gethostname()}: {text}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def prove_worker(kv):
    """The worker's roll call (see the module's docstring); returns once every server answered right."""
    import mxnet as mx
    secret, rank, size = os.environ.get(SECRET_ENV, ""), kv.rank, kv.num_workers * TAG_PIECES
    keys = proof_keys(commands.num_servers(kv))
    nonce = secrets.token_hex(16)
    waiting = ["the servers to take our signed hello"]
    done = threading.Event()

    def watchdog():
        if not done.wait(WORKER_TIMEOUT):
            _fail(f"rank {rank}: the roll call is not done after {WORKER_TIMEOUT:g} s, waiting for {waiting[0]}: "
                  f"a process that does not know the job secret may hold that rank; {PRIVATE_NETWORK}")

    threading.Thread(target=watchdog, daemon=True, name="ssdsgd-roll-call").start()
    commands.send(kv, commands.HELLO, rank=rank, nonce=nonce,
                  addresses=[local for state, local, _ in own_sockets() if state == "01"])
    waiting[0] = "every worker's hello (a barrier)"
    kv.init(keys, [mx.nd.zeros(size) for _ in keys])       # rank 0's push creates the keys; a barrier
    kv.push(keys, [mx.nd.zeros(size) for _ in keys])       # our updater writes the tags in
    for server, key in enumerate(keys):
        waiting[0] = f"server rank {server}'s answer"
        out = mx.nd.zeros(size)
        kv.pull(key, out=out)
        got = out.asnumpy()[rank * TAG_PIECES:(rank + 1) * TAG_PIECES]
        if not np.array_equal(got, tag(secret, server, rank, nonce)):
            _fail(f"rank {rank}: server rank {server} did not prove it belongs to the job (wrong answer to our "
                  f"signed hello): a process that does not know the job secret holds that rank; {PRIVATE_NETWORK}")
    done.set()


class RollCall:
    """A server's side: the tag owed to each worker rank that said hello, and the deadline for the rest.
    `sockets`: what lists this process's sockets (own_sockets; a stand-in in tests)."""

    def __init__(self, secret, sockets=own_sockets):
        self.secret = secret
        self.num_workers = int(os.environ[NUM_WORKER_ENV])
        self.sockets = sockets
        self.tags = {}                 # worker rank -> tag
        self.addresses = set()         # the local addresses the workers' hellos list
        self.complete = threading.Event()
        self.started = threading.Event()     # the clock runs (a hello came, or the start-up is over)
        self.until = 0.0                     # time.monotonic() of the deadline

    def watch(self):
        """Start the clock as soon as ps-lite's start-up is over (see the module's docstring), in a thread."""
        threading.Thread(target=self._watch, daemon=True, name="ssdsgd-roll-call-watch").start()

    def _watch(self):
        while not self.started.is_set():
            if len(connected_from(self.sockets())) >= self.num_workers + 1:     # the scheduler and every rank
                self._start()
                return
            time.sleep(0.05)

    def _start(self):
        """Start the clock, or move the deadline to HELLO_TIMEOUT from now (the first hello may come
        after the start-up was seen to end: the roll call is never shorter than before)."""
        self.until = max(self.until, time.monotonic() + HELLO_TIMEOUT)
        if not self.started.is_set():
            self.started.set()
            threading.Thread(target=self._deadline, daemon=True, name="ssdsgd-roll-call").start()

    def _deadline(self):
        while not self.complete.wait(max(0.0, self.until - time.monotonic())):
            if time.monotonic() >= self.until:
                _fail(self.missing())

    def missing(self):
        """The message naming the worker ranks without a valid hello and the unproven connections."""
        missing = sorted(set(range(self.num_workers)) - set(self.tags))
        who = (f"worker rank {missing[0]} has not proven that it belongs" if len(missing) == 1 else
               f"worker ranks {', '.join(map(str, missing))} have not proven that they belong")
        return (f"{who} to the job (no signed hello within {HELLO_TIMEOUT:g} s): a process that does not know the "
                f"job secret joined as a worker ({self._strangers()}), or a worker is stuck; {PRIVATE_NETWORK}")

    def _strangers(self):
        """Where the connections no hello accounts for come from (one from the scheduler's host is the
        scheduler's own)."""
        unproven = [a for a in connected_from(self.sockets()) if a not in self.addresses]
        scheduler = _host_ip(os.environ.get(SCHEDULER_HOST_ENV, ""))
        for a in unproven:
            if a.rpartition(":")[0].strip("[]") == scheduler:
                unproven.remove(a)
                break
        hosts = sorted({a.rpartition(":")[0] for a in unproven})
        if not hosts:
            return "ps-lite admits whoever reaches the scheduler's port; no connection left to name"
        return f"connected to this server from {', '.join(hosts)}"

    def hello(self, msg, server_rank):
        rank = msg["rank"]
        if not isinstance(rank, int) or not 0 <= rank < self.num_workers:
            raise ValueError(f"hello from worker rank {rank!r}, but the job has {self.num_workers} workers")
        if not self.tags:
            self._start()                    # the first hello
        self.addresses.update(str(a) for a in msg.get("addresses", []))
        self.tags[rank] = tag(self.secret, server_rank, rank, str(msg["nonce"]))
        if len(self.tags) == self.num_workers:
            self.complete.set()


    def answer(self, stored):
        """Our updater's part for a push to this server's proof key: write every known tag into it."""
        for rank, value in self.tags.items():
            stored[rank * TAG_PIECES:(rank + 1) * TAG_PIECES] = value
        stored.wait_to_read()


def _host_ip(host):
    try:
        return socket.gethostbyname(host) if host else None
    except OSError:
        return None

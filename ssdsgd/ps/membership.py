"""Every worker and server proves that it belongs to the job (knows the job secret) before training.

ps-lite admits any process that reaches the scheduler's port with the job's DMLC_* settings and gives it
a rank; our signed commands refuse what it sends, but the job would still wait on it. So, once the
KVStore exists and before anything else, every worker runs a roll call (one round trip per step):
  1. it sends every server a signed `hello` command with its rank and a fresh nonce; each server
     checks the signature and keeps, for that rank, tag(secret, server rank, worker rank, nonce);
  2. kv.init and one push of each server's proof key (a small key placed on that server): the push
     reaches our updater, which writes the tags of every rank that said hello into the key;
  3. it pulls each proof key and checks its own tag: the server at that rank knows the secret.
A server that has not heard a valid hello from every worker rank within HELLO_TIMEOUT of the first one
ends the job naming the missing rank (the clock starts at the first hello: a server's Python cannot see
when ps-lite's start-up, which waits for every node to register, is over, but the workers leave it
together and say hello at once; if strangers hold every worker rank, no hello comes and the job ends
at the stall timeout, the excluded workers making no progress); a worker whose roll call is not done
within WORKER_TIMEOUT (longer, so that a server, which knows which rank is missing, speaks first) ends it
naming what it waited for.
ps-lite does not expose a peer's address to MXNet (nor MXNet to Python): messages name ranks only.
"""
import hashlib
import hmac
import os
import secrets
import socket
import sys
import threading

import numpy as np

from ssdsgd.compression.fusion import KeyAllocator
from ssdsgd.env import NUM_WORKER_ENV, ROLE_NAME_ENV, SECRET_ENV
from ssdsgd.ps import commands

# Seconds from the first worker's signed hello to the last one's: all roles leave ps-lite's start-up
# together and a worker says hello at once (all within 0.1-0.3 s on a loaded 2-core machine).
HELLO_TIMEOUT = 5.0
WORKER_TIMEOUT = 2 * HELLO_TIMEOUT
PROOF_BASE_KEY = (1 << 20) + 16  # far above any plan key, past the probe and tally keys
TAG_PIECES = 8                 # a 128-bit tag as 16-bit pieces, each exact in a float32
PRIVATE_NETWORK = "keep the job's ports on a private network (README, Reliability)"


def proof_keys(num_servers):
    """Server rank -> its proof key (MXNet's key hash puts each key on that server)."""
    keys = KeyAllocator(num_servers, start=PROOF_BASE_KEY)
    return [keys.on(r) for r in range(num_servers)]


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
    commands.send(kv, commands.HELLO, rank=rank, nonce=nonce)
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
    """A server's side: the tag owed to each worker rank that said hello, and the deadline for the rest."""

    def __init__(self, secret):
        self.secret = secret
        self.num_workers = int(os.environ[NUM_WORKER_ENV])
        self.tags = {}                 # worker rank -> tag
        self.complete = threading.Event()

    def _deadline(self):
        if not self.complete.wait(HELLO_TIMEOUT):
            missing = sorted(set(range(self.num_workers)) - set(self.tags))
            who = (f"worker rank {missing[0]} has not proven that it belongs" if len(missing) == 1 else
                   f"worker ranks {', '.join(map(str, missing))} have not proven that they belong")
            _fail(f"{who} to the job (no signed hello within {HELLO_TIMEOUT:g} s of the first): a process that "
                  f"does not know the job secret joined as a worker (ps-lite admits whoever reaches the "
                  f"scheduler's port; MXNet does not expose its address), or a worker is stuck; {PRIVATE_NETWORK}")

    def hello(self, msg, server_rank):
        rank = msg["rank"]
        if not isinstance(rank, int) or not 0 <= rank < self.num_workers:
            raise ValueError(f"hello from worker rank {rank!r}, but the job has {self.num_workers} workers")
        if not self.tags:
            threading.Thread(target=self._deadline, daemon=True, name="ssdsgd-roll-call").start()
        self.tags[rank] = tag(self.secret, server_rank, rank, str(msg["nonce"]))
        if len(self.tags) == self.num_workers:
            self.complete.set()

    def answer(self, stored):
        """Our updater's part for a push to this server's proof key: write every known tag into it."""
        for rank, value in self.tags.items():
            stored[rank * TAG_PIECES:(rank + 1) * TAG_PIECES] = value
        stored.wait_to_read()

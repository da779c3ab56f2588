"""The server role: MXNet's KVStore server loop with our controller and updater.

Commands from workers travel as signed JSON data (ssdsgd.ps.commands), never as pickles: the stock
server would unpickle whatever arrives. The one updater installed on the server dispatches by key:
  - keys of a round-based plan (SSD-SGD, compressed SSGD): weight / mailbox / clock keys, handled by
    RoundService with the numpy global update of ssdsgd.ps.rounds;
  - the evaluation tally key (ssdsgd.ps.eval_tally) and the link probe's keys (density: auto): every push is
    added into them;
  - any other key: the stock MXNet optimizer built from the `stock_optimizer` command, so the SSGD
    (dist_sync) and ASGD (dist_async) baselines run with stock semantics against this same process.
An exception inside the updater would be swallowed by MXNet's ctypes callback and leave the weights
silently untouched; we print it and end the process, so the launcher fails the whole job.
"""
import os
import sys
import traceback

import numpy as np

from ssdsgd.checkpoint import SERVER_STOCK, CheckpointError, load_npz, save_npz, server_buffer_file, server_stock_file
from ssdsgd.compression.codec import WireFormat
from ssdsgd.env import ROLE_ENV, SECRET_ENV, rank_line
from ssdsgd.errors import JobError
from ssdsgd.lean_mxnet import import_mxnet
from ssdsgd.ps import commands
from ssdsgd.ps.eval_tally import TALLY_KEY
from ssdsgd.ps.keys import LINK_PROBE_KEYS
from ssdsgd.ps.membership import RollCall, proof_keys
from ssdsgd.ps.ring import DownlinkRing, RingLayout, StagedRings
from ssdsgd.ps.rounds import BufferState
from ssdsgd.schedule import LRSchedule


def _die(what):
    err = sys.exc_info()[1]
    if isinstance(err, JobError):       # a checkpoint file that cannot be written or read: its one line says it
        print(f"ssdsgd server: {what}: {err}", file=sys.stderr, flush=True)
    else:
        print(f"ssdsgd server: {what}", file=sys.stderr, flush=True)
        traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


class RoundService:
    """Server-side state of a round-based plan. `nd` is mxnet.ndarray (passed in for testability)."""

    def __init__(self, plan, nd):
        self.nd = nd
        self.roles = {}        # key -> (buffer id, 'weight' | 'mailbox' | 'clock' | 'ring' | 'mom', stage)
        self.states = {}       # buffer id -> BufferState
        self.stored = {}       # buffer id -> {'weight': NDArray, 'clock': NDArray}
        schedule = LRSchedule.from_dict(plan["schedule"])
        for buf in plan["buffers"]:
            b = buf["id"]
            self.roles[buf["weight_key"]] = (b, "weight", None)
            self.roles[buf["clock_key"]] = (b, "clock", None)
            formats = []
            # One mailbox per density stage (compression.warmup), the steady state last.
            for stage, box in enumerate(buf["mailboxes"]):
                self.roles[box["key"]] = (b, "mailbox", stage)
                formats.append(WireFormat.from_dict(box))
            self.states[b] = BufferState(buf["size"], plan["num_workers"], plan["batch_size"],
                                         plan["momentum"], plan["wd"], schedule, formats,
                                         plan.get("delay_momentum"), plan.get("warmup", 0),
                                         plan.get("delay_lr_factor", 1.0))
            self.stored[b] = {}
            down = buf.get("downlink")
            if down:
                # Sparse downlink: per density stage a ring of the last rounds' aggregated updates,
                # and the momentum (with its version) for a worker that must rebuild its replica
                # from the dense state.
                rings = []
                for stage, ring in enumerate(down["rings"]):
                    if ring is not None:
                        self.roles[ring["key"]] = (b, "ring", stage)
                        ring = DownlinkRing(RingLayout.of_plan(buf["size"], down, ring), down.get("check_every", 0))
                    rings.append(ring)
                self.roles[down["mom_key"]] = (b, "mom", None)
                self.states[b].ring = StagedRings(rings, down["first_rounds"])

    def owns(self, key):
        return key in self.roles

    def summary(self):
        """What this server served, for the line it prints at the end: per buffer it holds (its weight
        key was bound here) the number of its keys and the rounds applied, e.g.
        "buffers 1 (5 keys, 40 rounds), 3 (5 keys, 40 rounds)"; "no buffers" when it held none."""
        held = [b for b, st in sorted(self.states.items()) if st.weights is not None]
        if not held:
            return "no buffers"
        keys = {b: sum(1 for role in self.roles.values() if role[0] == b) for b in held}
        return "buffers " + ", ".join(f"{b} ({keys[b]} keys, {self.states[b].version} rounds)" for b in held)

    def save(self, directory):
        for b, st in self.states.items():
            if st.weights is None:
                continue                      # this buffer lives on another server
            d = st.state_dict()
            rounds = sorted(d["pending"])
            held = [(r, q) for r in rounds for q in sorted(d["pending"][r][2])]
            arrays = {"weights": d["weights"], "mom": d["mom"],
                      "pending_sums": np.stack([d["pending"][r][0] for r in rounds])
                      if rounds else np.zeros((0, st.size), np.float32),
                      "pending_held": np.stack([d["pending"][r][2][q] for r, q in held])
                      if held else np.zeros((0, st.size), np.float32)}
            if d["residual"] is not None:
                arrays["residual"] = d["residual"]        # the compressed downlink's error feedback
            meta = {"version": d["version"], "pending": {str(r): d["pending"][r][1] for r in rounds},
                    "held": held}
            save_npz(os.path.join(directory, server_buffer_file(b)), arrays, meta)

    def load(self, directory):
        for b, st in self.states.items():
            if st.weights is None:
                continue
            path = os.path.join(directory, server_buffer_file(b))
            arrays, meta = load_npz(path)
            for name, shape in (("weights", (st.size,)), ("mom", (st.size,))):
                got = arrays[name].shape if name in arrays else None
                if got != shape:
                    raise CheckpointError(f"{path}: {name} has shape {got}, but buffer {b} of this run's plan "
                                          f"has {st.size} elements; the checkpoint's plan cannot be served")
            held = {}
            for i, (r, q) in enumerate(meta["held"]):
                held.setdefault(int(r), {})[int(q)] = arrays["pending_held"][i]
            pending = {int(r): (arrays["pending_sums"][i], ranks, held.get(int(r), {}))
                       for i, (r, ranks) in enumerate(sorted(meta["pending"].items(), key=lambda x: int(x[0])))}
            st.load_state_dict({"weights": arrays["weights"], "mom": arrays["mom"], "residual": arrays.get("residual"),
                                "version": meta["version"], "pending": pending})
            self._publish(b)

    def _publish(self, b):
        st, state = self.states[b], self.stored[b]
        # The version rides in the last element of the weight buffer, so one pull gives the
        # weights and exactly which round they are.
        state["weight"][:] = np.append(st.weights, np.float32(st.version))
        state["clock"][:] = np.float32(st.version)
        state["weight"].wait_to_read()
        state["clock"].wait_to_read()
        if st.ring is not None:
            published = [state["mom"]]
            state["mom"][:] = np.append(st.mom, np.float32(st.version))
            # Only the rings that changed: a finished stage's ring is not copied again every round.
            for stage in sorted(st.ring.changed):
                state[f"ring{stage}"][:] = st.ring.rings[stage].array
                published.append(state[f"ring{stage}"])
            st.ring.changed.clear()
            for a in published:
                a.wait_to_read()

    def push(self, key, recv, stored):
        b, role, stage = self.roles[key]
        state = self.stored[b]
        if role in ("weight", "clock", "ring", "mom"):
            # A "bind" push: keep a reference to the stored array so the mailbox handler can write
            # the global update into it (the updater is only ever handed the array of its own key).
            name = f"ring{stage}" if role == "ring" else role
            if name not in state:
                state[name] = stored
                if role == "weight":
                    w = stored.asnumpy()
                    self.states[b].bind(w[:-1], version=int(w[-1]))
            return
        if "weight" not in state or "clock" not in state:
            raise RuntimeError(f"buffer {b}: mailbox push before its weight and clock keys were bound")
        ring = self.states[b].ring
        if ring is not None and ("mom" not in state or any(
                f"ring{stage}" not in state for stage, r in enumerate(ring.rings) if r is not None)):
            raise RuntimeError(f"buffer {b}: mailbox push before its downlink ring and momentum keys were bound")
        if self.states[b].receive(recv.asnumpy(), stage):
            self._publish(b)


def _save_stock(stock, rank, directory):
    """The stock path's optimizer state (an mx.optimizer updater) into this server's file."""
    opt = stock.optimizer
    arrays = {f"state{k}": v.asnumpy() for k, v in stock.states.items() if v is not None}
    meta = {"counts": {str(k): c for k, c in opt._index_update_count.items()},
            "num_update": opt.num_update}
    save_npz(os.path.join(directory, server_stock_file(rank)), arrays, meta)


def _load_stock(stock, directory, nd):
    # Which server holds which key follows from the key alone, but server ranks may be
    # assigned differently in the new job: read every server's file and keep all keys.
    opt, seen = stock.optimizer, {}
    for name in sorted(os.listdir(directory)):
        if not name.startswith(SERVER_STOCK):
            continue
        arrays, meta = load_npz(os.path.join(directory, name))
        for k, c in meta["counts"].items():
            if int(k) in seen:
                raise CheckpointError(f"key {k} is in {seen[int(k)]} and {name}: keys split across "
                                      "servers cannot be resumed on the stock KVStore path")
            seen[int(k)] = name
            opt._index_update_count[int(k)] = c
            if f"state{k}" in arrays:
                stock.states[int(k)] = nd.array(arrays[f"state{k}"])
                stock.states_synced[int(k)] = True
        opt.num_update = max(opt.num_update, meta["num_update"])


def _checkpoint(server, op, directory, nd):
    """The SAVE or LOAD command: this server's round-plan buffers and stock optimizer state."""
    if server.rounds is not None:
        (server.rounds.save if op == commands.SAVE else server.rounds.load)(directory)
    if server.stock is not None and op == commands.SAVE:
        _save_stock(server.stock, server.kvstore.rank, directory)
    elif server.stock is not None:
        _load_stock(server.stock, directory, nd)


def _dispatch_push(server, key, recv, stored):
    """The updater: a push of `key` to this server (see the module's docstring for who handles which)."""
    if key in server.proof_keys:
        server.roll_call.answer(stored)
    elif server.rounds is not None and server.rounds.owns(key):
        server.rounds.push(key, recv, stored)
    elif key == TALLY_KEY or key in LINK_PROBE_KEYS:
        stored += recv
        stored.wait_to_read()
    elif server.stock is not None:
        server.stock(key, recv, stored)
        stored.wait_to_read()   # async mode frees recv as soon as we return
    else:
        raise RuntimeError(f"push to key {key} but no optimizer or plan was set up")


def _handle_command(server, msg, mx):
    """A verified command (ssdsgd.ps.commands) on this server."""
    if not server.updater_installed:
        # The C++ server object exists only once run() has started, i.e. from the first
        # command on; commands always precede the first push.
        server.kvstore._set_updater(server._update)
        server.updater_installed = True
        # Our server rank (ps-lite knows it only once the loop runs): the launcher labels our
        # output and messages with it, the rank the workers' key placement and messages use.
        print(rank_line(server.kvstore.rank), flush=True)
    op = msg["op"]
    if op == commands.HELLO:
        server.roll_call.hello(msg, server.kvstore.rank)
    elif op == commands.STOCK_OPTIMIZER:
        sched = LRSchedule.from_dict(msg["schedule"])
        opt = mx.optimizer.SGD(learning_rate=msg["lr"], momentum=msg["momentum"], wd=msg["wd"],
                               rescale_grad=msg["rescale_grad"], lr_scheduler=sched)
        server.stock = mx.optimizer.get_updater(opt)
    elif op == commands.ROUND_PLAN:
        server.rounds = RoundService(msg, mx.nd)
    elif op in (commands.SAVE, commands.LOAD):
        _checkpoint(server, op, msg["dir"], mx.nd)
    else:
        raise ValueError(f"unknown command op {op!r}")


def run_server():
    role = os.environ[ROLE_ENV]
    # `import mxnet` with DMLC_ROLE=server|scheduler would enter the stock server loop inside the
    # import; pretend to be a worker until mxnet is fully imported, then restore the real role
    # (ps-lite reads it again at kv.create).
    os.environ[ROLE_ENV] = "worker"
    mx = import_mxnet()
    from mxnet.kvstore.kvstore_server import KVStoreServer
    os.environ[ROLE_ENV] = role

    secret = os.environ.get(SECRET_ENV, "")

    class SSDServer(KVStoreServer):
        def __init__(self, kvstore):
            super().__init__(kvstore)
            self.rounds = None
            self.stock = None
            self.updater_installed = False
            self.roll_call = RollCall(secret)
            self.senders = {}          # sender -> the last sequence number taken (commands.verify)
            self.proof_keys = set(proof_keys(commands.num_servers(kvstore)))

        def _update(self, key, recv, stored):
            try:
                _dispatch_push(self, key, recv, stored)
            except BaseException:
                _die(f"updater failed on key {key}")

        def _controller(self):
            def ctl(cmd_id, body, _):
                try:
                    msg = commands.verify(body, secret, self.senders)
                except commands.CommandError as err:
                    print(f"ssdsgd server: refused command (head {cmd_id}): {err}", file=sys.stderr,
                          flush=True)
                    return
                try:
                    _handle_command(self, msg, mx)
                except BaseException:
                    _die(f"command {msg.get('op')!r} failed")
            return ctl

    server = SSDServer(mx.kv.create("dist"))
    server.roll_call.watch()          # the roll call's clock starts once ps-lite's start-up is over
    server.run()
    if server.rounds is not None:     # how the plan's buffers spread over the servers, from each one's side
        print(f"ssdsgd server: served {server.rounds.summary()}", flush=True)

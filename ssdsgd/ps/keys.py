"""The servers' keys: which server holds a key, and fresh keys placed on a chosen server.

MXNet's client sends a key to server (key * KEY_HASH) % S as long as its array is below
MXNET_KVSTORE_BIGARRAY_BOUND elements (the round-based client raises the bound so buffers are never
split), and a server's updater can only write arrays it stores. So a buffer's weight, mailbox, clock
and downlink keys are all chosen to land on the buffer's server. Every key a job uses is placed here:
the buffers of a round-based plan (compression.fusion groups the tensors; this module puts each group
on a server), their warm-up mailboxes and downlink rings, the stock path's parameter keys and the roll
call's proof keys (ssdsgd.ps.membership).
"""
KEY_HASH = 9973  # ps-lite key placement in MXNet's KVStoreDist
MXNET_BIGARRAY_BOUND = 1000 * 1000     # MXNet's default of MXNET_KVSTORE_BIGARRAY_BOUND
# compression.density: auto's link probe (ssdsgd.algorithms.probe.measure_link): a small and a large key
# timed by pushes and pulls, and the key gathering every worker's measurements. The servers add every push
# into them, as into the evaluation tally's key. Far above any plan key, past the tally's.
LINK_PROBE_KEYS = ((1 << 20) + 4, (1 << 20) + 5, (1 << 20) + 6)


class KeyAllocator:
    """Fresh keys, each one placed on a chosen server by MXNet's key hash."""

    def __init__(self, num_servers, start=0):
        self.num_servers = num_servers
        self.next = start

    def on(self, server):
        k = self.next
        while (k * KEY_HASH) % self.num_servers != server:
            k += 1
        self.next = k + 1
        return k


def balanced_keys(sizes, num_servers, bound=MXNET_BIGARRAY_BOUND):
    """A key per parameter (sizes: element counts) such that the servers hold nearly equal shares of
    the elements and of the keys (a server's CPU per step grows with both): largest first, each to
    the least-loaded server that holds fewer than its share of the keys (arrays of `bound` elements or
    more MXNet splits over every server, so they load each equally), then keys in parameter order
    that hash to the chosen servers. With one server: 0..n-1. (Keys numbered 0..n-1 would leave the
    servers' shares uneven: docs/design.md, "Speed past two workers and one server".)"""
    load, count, server = [0.0] * num_servers, [0] * num_servers, [0] * len(sizes)
    most = -(-len(sizes) // num_servers)                # keys per server at most
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if sizes[i] >= bound:                           # the key does not place it
            load = [x + sizes[i] / num_servers for x in load]
            continue
        server[i] = min((s for s in range(num_servers) if count[s] < most), key=lambda s: (load[s], s))
        load[server[i]] += sizes[i]
        count[server[i]] += 1
    keys = KeyAllocator(num_servers)
    return [keys.on(s) for s in server]


def place_buffers(buffers, num_servers):
    """Each buffer of a plan (compression.fusion.Buffer) on the least-loaded server (largest first), then
    its weight, mailbox and clock keys, which hash to that server; in place, and returned."""
    load = [0] * num_servers
    for buf in sorted(buffers, key=lambda b: -b.size):
        buf.server = min(range(num_servers), key=lambda s: (load[s], s))
        load[buf.server] += buf.size
    keys = KeyAllocator(num_servers)
    for buf in buffers:
        buf.weight_key = keys.on(buf.server)
        buf.mailbox_key = keys.on(buf.server)
        buf.clock_key = keys.on(buf.server)
    return buffers


def place_stages(stages, num_servers):
    """The buffers of every density stage (compression.warmup; the steady state last), in place: the
    steady state's by place_buffers, each warm-up stage's buffer on its steady buffer's server with its
    weight and clock keys and a mailbox key of its own (a key's size is fixed at kv.init), after every
    steady key, stage by stage."""
    steady = place_buffers(stages[-1], num_servers)
    keys = KeyAllocator(num_servers, start=max(max(b.weight_key, b.mailbox_key, b.clock_key) for b in steady) + 1)
    for bufs in stages[:-1]:
        for b, s in zip(bufs, steady):
            b.server, b.weight_key, b.clock_key = s.server, s.weight_key, s.clock_key
            b.mailbox_key = keys.on(s.server)

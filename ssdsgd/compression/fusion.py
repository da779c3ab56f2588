"""Buffer plan: which parameters are fused into which buffer (ssdsgd.ps.keys then puts each buffer on a
server, under keys that hash there).

Every worker computes the plan from the parameter shapes alone, so all workers get the identical
plan (same buffers, same mailbox sizes: the inter-worker alignment SAFusion relies on) without
exchanging it. Buffers group consecutive parameters in backward order (last layer first), so the
first buffer is complete earliest and its push overlaps the rest of backward.
"""
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from ssdsgd.compression.codec import WireFormat, max_buffer_elements
from ssdsgd.compression.registry import is_sparsifier


@dataclass
class Buffer:
    id: int
    params: list                  # parameter indices (forward order numbering), in backward order
    offsets: list                 # element offset of each parameter inside the buffer
    sizes: list                   # element count of each parameter
    counts: list                  # values sent per parameter (k_i; equal to sizes when dense)
    server: int = 0               # where ssdsgd.ps.keys places it, and its keys there
    weight_key: int = -1
    mailbox_key: int = -1
    clock_key: int = -1
    codec: str = "dense"
    fp16: bool = False            # fp16 wire format (compression.fp16_values, sparse only)
    # compression.index_coding (sparse only): auto | list. "list" here and in make_plan, so a plan made
    # without a config keeps the plain layout; plan_for_config passes the config's (default auto).
    index_coding: str = "list"

    @property
    def size(self):
        return sum(self.sizes)

    @property
    def topk_count(self):
        """Values one message sends (the sum of the per-tensor counts; the buffer's size when dense)."""
        return sum(self.counts)

    @property
    def wire(self):
        """This buffer's mailbox messages (codec.WireFormat)."""
        return WireFormat.planned(self.size, self.topk_count if self.codec == "sparse" else None, self.fp16,
                                  self.index_coding)

    def to_dict(self, stages=None):
        """What the server needs; `stages`: this buffer in every density stage, steady state last."""
        return {"id": self.id, "size": self.size, "weight_key": self.weight_key,
                "clock_key": self.clock_key, "server": self.server,
                "mailboxes": [dict(b.wire.to_dict(), key=b.mailbox_key) for b in (stages or [self])]}


def describe_sizes(sizes, most=12):
    """A plan's buffer sizes for a message: '3 buffers of 10, 20, 30 elements' (the first `most`)."""
    if not isinstance(sizes, list):
        return repr(sizes)
    return f"{len(sizes)} buffers of {', '.join(map(str, sizes[:most]))}{'...' if len(sizes) > most else ''} elements"


def group_fixed(sizes_backward, max_elements, num_servers=1):
    """Consecutive groups (of positions in backward order) of at most max_elements each (a tensor
    larger than that alone), as many as the smallest multiple of num_servers allows, each as close
    to the mean as whole tensors allow (group_even): every server then holds as many buffers of
    about the same size. (Filling each group up to the cap left ResNet-50's 32 MiB buffers at 8.2,
    7.6, 6.6 and 3.2 M elements: one of 4 servers 50% off the servers' mean, 4 of 8 servers idle.)"""
    fewest = len(group_greedy(sizes_backward, max_elements))      # greedy filling needs the fewest groups
    step = max(1, num_servers)
    return group_even(sizes_backward, step * -(-fewest // step), max_elements)


def group_greedy(sizes_backward, max_elements):
    """Consecutive groups of at most max_elements each, each filled until the next tensor would not fit."""
    groups, cur, cur_n = [], [], 0
    for pos, n in enumerate(sizes_backward):
        if cur and cur_n + n > max_elements:
            groups.append(cur)
            cur, cur_n = [], 0
        cur.append(pos)
        cur_n += n
    if cur:
        groups.append(cur)
    return groups


def group_even(sizes_backward, parts, max_elements=None):
    """`parts` consecutive groups (one buffer per server) with element counts as close to the mean as
    splits between whole tensors allow: the partition minimising the largest |group - mean|, by
    dynamic programming over the split points; with max_elements, among the partitions whose groups
    hold at most that many (or one tensor). (Splitting where the running sum first reaches the next
    even share can leave one server twice the mean: ResNet-50 over 8 servers.) Integer arithmetic
    and first-minimum ties, so every worker makes the identical plan."""
    count = len(sizes_backward)
    parts = max(1, min(parts, count))
    if count == 0:
        return []
    pre = np.concatenate([[0], np.cumsum(np.asarray(sizes_backward, dtype=np.int64))])
    total = int(pre[-1])
    # worst[i]: the least possible largest |parts * group - total| of the first i tensors in p groups;
    # cut[p][i]: where the last of those p groups starts.
    worst = np.full(count + 1, np.iinfo(np.int64).max, np.int64)
    worst[0] = 0
    cut = np.zeros((parts + 1, count + 1), np.int64)
    for p in range(1, parts + 1):
        new = np.full_like(worst, np.iinfo(np.int64).max)
        for i in range(p, count - (parts - p) + 1):     # leave a tensor for each later group
            starts = np.arange(p - 1, i)
            cost = np.maximum(worst[starts], np.abs(parts * (pre[i] - pre[starts]) - total))
            if max_elements is not None:    # too big, and more than one tensor: not a partition to take
                cost[(pre[i] - pre[starts] > max_elements) & (i - starts > 1)] = np.iinfo(np.int64).max
            best = int(np.argmin(cost))
            new[i], cut[p][i] = cost[best], starts[best]
        worst = new
    groups, i = [], count
    for p in range(parts, 0, -1):
        groups.append(list(range(int(cut[p][i]), i)))
        i = int(cut[p][i])
    return groups[::-1]


def group_balanced(sizes_backward, parts):
    """`parts` groups of whole tensors (positions in backward order), not necessarily consecutive: the
    largest tensor first (ties: the earlier position) into the group with the fewest elements so far
    (ties: the earlier group). Each group lists its positions in order; the groups are ordered by when
    they become ready in backward, their last position. Integers only: every worker makes this plan."""
    parts = max(1, min(parts, len(sizes_backward)))
    groups, load = [[] for _ in range(parts)], [0] * parts
    for pos in sorted(range(len(sizes_backward)), key=lambda p: (-sizes_backward[p], p)):
        g = min(range(parts), key=lambda i: (load[i], i))
        groups[g].append(pos)
        load[g] += sizes_backward[pos]
    return sorted((sorted(g) for g in groups if g), key=lambda g: g[-1])


def largest_deviation(sizes_backward, groups):
    """The largest |group's elements - mean| over the groups, as a share of the mean."""
    sums = [sum(sizes_backward[p] for p in g) for g in groups]
    total = sum(sums)
    return max(abs(len(sums) * x - total) for x in sums) / total if total else 0.0


# compression.buffers: one keeps consecutive tensors together (a buffer can then be sent as soon as its part
# of backward is done) unless that leaves a server more than this share off the mean size and assigning whole
# tensors largest first (group_balanced) does not. ResNet-20 on 4 servers: 15% off consecutively, 8% so (it
# cannot do better: 5 of its tensors are 54% of a server's share each); ResNet-50 on 4: 3% consecutively.
CONSECUTIVE_TOLERANCE = 0.10


def group_one_per_server(sizes_backward, num_servers):
    """compression.buffers: one's groups: group_even's consecutive split, or group_balanced's where only
    that one is within CONSECUTIVE_TOLERANCE of the mean."""
    groups = group_even(sizes_backward, num_servers)
    if largest_deviation(sizes_backward, groups) > CONSECUTIVE_TOLERANCE:
        balanced = group_balanced(sizes_backward, num_servers)
        if largest_deviation(sizes_backward, balanced) <= CONSECUTIVE_TOLERANCE:
            return balanced
    return groups


def warmup_stages(buffers, stage_counts):
    """The plan once per density stage of the compression warm-up: the same buffers with that stage's
    counts (ssdsgd.ps.keys.place_stages gives each its own mailbox key). stage_counts: per stage, the
    values sent per parameter (forward numbering)."""
    return [[replace(b, counts=[counts[i] for i in b.params]) for b in buffers] for counts in stage_counts]


def plan_cost_model(sizes, counts, sparse, alpha, beta, backward, fp16=False, index_coding="list"):
    """Groups (positions in backward order) minimising when the last buffer's push ends.

    Model (SAFusion's, with the constants measured at job start instead of fitted offline):
    tensor i's gradient is ready after backward * (elements so far) / (all elements); a buffer
    can go once its last gradient is ready and the previous buffer has left; sending it costs
    alpha + beta * bytes. Fusing saves alpha per buffer but delays the send until the whole buffer
    is ready; dynamic programming over the split points finds the best trade-off.
    """
    n = len(sizes)
    sizes_bwd, counts_bwd = sizes[::-1], counts[::-1]
    total = float(sum(sizes))
    ready, acc = [], 0
    for s in sizes_bwd:
        acc += s
        ready.append(backward * acc / total)

    cap = max_buffer_elements(fp16)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        elements = values = 0            # of tensors j..i-1, the candidate last buffer
        for j in range(i - 1, -1, -1):
            elements += sizes_bwd[j]
            values += counts_bwd[j]
            if elements > cap:
                break
            wire = WireFormat.planned(elements, values if sparse else None, fp16, index_coding)
            send = alpha + beta * wire.bytes
            end = max(ready[i - 1], best[j]) + send
            if end < best[i]:
                best[i], cut[i] = end, j
    groups, i = [], n
    while i > 0:
        groups.append(list(range(cut[i], i)))
        i = cut[i]
    return groups[::-1]


def make_plan(shapes, num_servers, *, mode="one", buffer_bytes=4 << 20, counts=None, codec="dense",
              groups=None, fp16=False, index_coding="list"):
    """shapes: parameter shapes in forward order. counts: values sent per parameter (None = dense).

    mode 'one': one buffer per server (the whole model when S = 1; group_one_per_server), or as few as fit
    where a server's share is over what one buffer can hold (group_fixed at that size); 'consecutive':
    one buffer per server, always group_even's consecutive split (how 'one' split before); 'fixed': at most
    buffer_bytes of parameters, a multiple of S of them, evenly sized; or explicit `groups` of
    positions in backward order (cost model).
    Returns a list of Buffer in the order they become ready.
    """
    sizes = [int(_numel(s)) for s in shapes]
    counts = sizes if counts is None else list(counts)
    order = list(range(len(shapes)))[::-1]                   # backward order
    sizes_bwd = [sizes[i] for i in order]
    max_elements = max_buffer_elements(fp16)
    cap = min(max_elements, max(1, buffer_bytes // 4))
    if groups is None:
        if mode == "one":
            groups = group_one_per_server(sizes_bwd, num_servers)
            if max(sum(sizes_bwd[pos] for pos in g) for g in groups) > max_elements:
                # A server's share is more than one buffer can index (ResNet-50 on 1 server): as few
                # buffers as fit, as many on every server, rather than refusing the default.
                groups = group_fixed(sizes_bwd, max_elements, num_servers)
        elif mode == "consecutive":
            groups = group_even(sizes_bwd, num_servers)
        elif mode == "fixed":
            groups = group_fixed(sizes_bwd, cap, num_servers)
        else:
            raise ValueError(f"unknown buffer mode {mode!r}")
    for i, n in enumerate(sizes):
        if n > max_elements:
            raise ValueError(f"parameter {i} of shape {tuple(shapes[i])} has {n} elements, more than one "
                             f"buffer can hold ({max_elements}"
                             + (", the limit of the fp16 wire's two index digits); set "
                                "compression.fp16_values: false" if fp16 else ")"))
    buffers = []
    for b, group in enumerate(groups):
        params = [order[pos] for pos in group]
        psizes = [sizes[i] for i in params]
        if sum(psizes) > max_elements:
            raise ValueError(f"buffer {b} has {sum(psizes)} elements, more than one buffer can hold "
                             f"({max_elements}); use compression.buffers: one or fixed, or more servers")
        offsets, off = [], 0
        for n in psizes:
            offsets.append(off)
            off += n
        buffers.append(Buffer(id=b, params=params, offsets=offsets, sizes=psizes,
                              counts=[counts[i] for i in params], codec=codec, fp16=fp16,
                              index_coding=index_coding))
    return buffers


class TensorCounts(NamedTuple):
    sizes: list                   # elements per tensor
    counts: list                  # values each tensor sends per step
    whole: list                   # per tensor: sent whole (below compression.min_dense_bytes)


def tensor_counts(shapes, comp, density=None):
    """Values each tensor sends: k_i = max(1, floor(density * n_i)), or all of a small tensor."""
    density = comp.density if density is None else density
    if density == "auto":
        if is_sparsifier(comp.type):
            raise ValueError("compression.density: auto is chosen as the job starts; count with the density "
                             "chosen (ssdsgd.config.with_density)")
        density = 1.0              # without a sparsifier the density is idle: every value is sent
    sizes = [int(_numel(s)) for s in shapes]
    whole = [4 * n < comp.min_dense_bytes for n in sizes]
    counts = [n if w else max(1, int(density * n)) for n, w in zip(sizes, whole)]
    return TensorCounts(sizes, counts, whole)


def plan_for_config(shapes, num_servers, comp, cost=None, counted=None):
    """The buffers of the `compression` config section's steady state (what the servers hold).

    cost: {'alpha', 'beta', 'backward'} measured at job start (needed for buffers: cost_model);
    counted: tensor_counts(shapes, comp), if the caller has them.
    No mxnet here: the front end re-makes a checkpoint's plan with it before a resume starts."""
    sizes, counts, _ = counted or tensor_counts(shapes, comp)
    sparse = is_sparsifier(comp.type)
    if not sparse:
        counts = sizes
    codec = "sparse" if sparse else "dense"
    fp16 = sparse and comp.fp16_values
    coding = comp.index_coding
    if comp.buffers == "cost_model":
        if cost is None:
            raise ValueError("compression.buffers: cost_model needs the startup probe's measurements")
        groups = plan_cost_model(sizes, counts, sparse, **cost, fp16=fp16, index_coding=coding)
        return make_plan(shapes, num_servers, groups=groups, counts=counts, codec=codec, fp16=fp16,
                         index_coding=coding)
    return make_plan(shapes, num_servers, mode=comp.buffers, buffer_bytes=comp.buffer_bytes,
                     counts=counts, codec=codec, fp16=fp16, index_coding=coding)


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n

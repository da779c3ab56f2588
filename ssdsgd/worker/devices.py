"""The model on a worker's devices: one replica per device (GPUs, or CPU contexts), and the host copies of
its trainable parameters that the clients (ssdsgd/algorithms) and the compressor work on.

A worker with D devices splits its batch over them and runs forward and backward on each replica. Then
`gather` sums the replicas' gradients into host memory, the client pushes, pulls and updates the host
weights as on one device, and `scatter` writes the host weights back to every replica. Both move small
consecutive parameters in buckets (BUCKET_VALUES), as one flat vector per device: one operator gathers a
bucket's tensors into it, one copy moves it, one operator cuts it up again (per tensor, the Python calls
would cost more than the copies); a large parameter (ALONE_VALUES) moves alone, copied directly, since a
staging copy of it would cost more than the call it saves. The clients see `host`: objects with the Gluon
parameter's `name`, `shape`, `data()` and `grad()`, whose arrays live on the host (cpu(0)). This is the one
module that reads a Gluon parameter through its devices; everything else reads `host`.

One replica on cpu(0) is the host itself: `host` then hands out the parameter's own arrays and gather and
scatter do nothing, which is the single-device path exactly. Several CPU replicas are cpu(1) ... cpu(D),
never cpu(0), so that a parameter read without its context fails on CPU as it would on a GPU
(Gluon resolves `p.data()` through the current context, cpu(0)).

BatchNorm's running statistics stay per replica (as gluoncv's multi-GPU recipes keep them); the first
replica's are the ones evaluation uses and final.params records.
"""
import os

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from ssdsgd.compression.flatviews import FlatViews
from ssdsgd.errors import CheckpointError, JobError
from ssdsgd.worker.models import aux_params

HOST = mx.cpu(0)


class DeviceError(JobError):
    """The devices a config asks for are not there (no GPU build of MXNet, fewer GPUs than train.devices)."""


def gpu_build():
    """Was this MXNet built with CUDA? (The CPU wheel answers False without touching a driver.)"""
    return mx.runtime.Features().is_enabled("CUDA")


def check_gpu_build():
    """Raise DeviceError where this MXNet cannot run on GPUs at all."""
    if not gpu_build():
        raise DeviceError(f"cluster.device: gpu, but this MXNet ({mx.__version__}) was built without CUDA: "
                          f"install a GPU build (README: GPUs), or set cluster.device: cpu")


def worker_contexts(device, count):
    """The contexts of a worker's replicas: cluster.device (cpu or gpu) and train.devices (count)."""
    if device == "cpu":
        return [HOST] if count == 1 else [mx.cpu(i) for i in range(1, count + 1)]
    check_gpu_build()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    found = mx.context.num_gpus()
    if found < count:
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise DeviceError(f"train.devices: {count} GPUs asked for, but this worker sees {found}{shown}")
    return [mx.gpu(i) for i in range(count)]


class HostParameter:
    """A trainable parameter as the clients see it: its weights and its gradient (the sum over the
    worker's devices) as host arrays. The arrays stay the same objects for the whole run."""
    __slots__ = ("name", "shape", "_data", "_grad")

    def __init__(self, name, shape, data, grad):
        self.name, self.shape, self._data, self._grad = name, tuple(shape), data, grad

    def data(self):
        return self._data

    def grad(self):
        return self._grad


# Values per bucket: the parameters move between host and devices in buckets of consecutive parameters,
# so that a bucket's gradients go to the host as soon as backward has produced them (backward ends with the
# first layers), and the first layers' weights reach the devices first for the next forward.
BUCKET_VALUES = 1 << 22
ALONE_VALUES = 1 << 16        # a parameter this large moves by itself, without the flat staging copy


class DeviceReplicas:
    """The model's trainable parameters (params, in the clients' order) and BatchNorm statistics (aux) on
    `contexts`, with their host copies."""

    def __init__(self, params, aux, contexts, bucket_values=BUCKET_VALUES, alone_values=ALONE_VALUES):
        self.params, self.aux, self.contexts = list(params), list(aux), list(contexts)
        self.first = self.contexts[0]
        self.on_host = self.contexts == [HOST]
        if self.on_host:
            self.host = [HostParameter(p.name, p.shape, p.data(HOST), p.grad(HOST)) for p in self.params]
            self.buckets = []
            return
        sizes = [int(np.prod(p.shape)) for p in self.params]
        starts = [int(x) for x in np.cumsum([0] + sizes)]
        self.weights = mx.nd.zeros(starts[-1], ctx=HOST)       # every host weight, as one flat vector
        self.grads = mx.nd.zeros(starts[-1], ctx=HOST)
        self.host = [HostParameter(p.name, p.shape, self.weights[a:b].reshape(p.shape),
                                   self.grads[a:b].reshape(p.shape))
                     for p, a, b in zip(self.params, starts, starts[1:])]
        self.buckets = [(_Alone if j == i + 1 and sizes[i] >= alone_values else _Bucket)(
            self.params[i:j], self.contexts, self.weights[starts[i]:starts[j]], self.grads[starts[i]:starts[j]])
            for i, j in _bucket_bounds(sizes, bucket_values, alone_values)]
        # The replicas start equal (Gluon initialises every context with the same values).
        for b in self.buckets:
            b.load_first()

    @classmethod
    def of_net(cls, net, params, contexts, **kwargs):
        return cls(params, aux_params(net), contexts, **kwargs)

    # ---- a step ---------------------------------------------------------------------------------------
    def split(self, data, label):
        """[(data, label)] per replica: the batch cut in order (the last replicas one image fewer where it
        does not divide), each part copied to its device."""
        if self.on_host:
            return [(data, label)]
        return list(zip(gluon.utils.split_and_load(data, self.contexts, even_split=False),
                        gluon.utils.split_and_load(label, self.contexts, even_split=False)))

    def forward(self, net, loss_fn, data, label):
        """The recorded forward pass on every replica: its per-sample losses, one array per replica."""
        parts = self.split(data, label)
        with autograd.record():
            return [loss_fn(net(x), y) for x, y in parts]

    def backward(self, losses):
        """Backward on every replica, the gradients summed into the host's."""
        autograd.backward(losses)
        self.gather()

    def forward_backward(self, net, loss_fn, data, label):
        """forward, then backward: the per-sample losses of the whole batch, on the host."""
        losses = self.forward(net, loss_fn, data, label)
        self.backward(losses)
        return losses[0] if self.on_host else mx.nd.concat(*[x.as_in_context(HOST) for x in losses], dim=0)

    def gather(self):
        """host grad <- the sum of the replicas' gradients (the last layers' bucket first: their gradients
        are ready first)."""
        for b in reversed(self.buckets):
            b.gather()

    def scatter(self):
        """Every replica's weights <- the host weights (queued after whatever last wrote them: a pull
        that lands later still lands first)."""
        for b in self.buckets:
            b.scatter()

    # ---- state -----------------------------------------------------------------------------------------
    def aux_arrays(self):
        """[[array per replica] per BatchNorm statistic]."""
        return [[p.data(c) for c in self.contexts] for p in self.aux]

    def state(self):
        """{"param<i>", "aux<i>" (the first replica's), "aux<i>.replica<d>" (the others')}: numpy arrays of
        the host weights and every replica's BatchNorm statistics, for a checkpoint."""
        out = {f"param{i}": p.data().asnumpy() for i, p in enumerate(self.host)}
        for i, per_replica in enumerate(self.aux_arrays()):
            for d, a in enumerate(per_replica):
                out[_aux_key(i, d)] = a.asnumpy()
        return out

    def load_state(self, arrays):
        """The inverse of state(): host weights and each replica's statistics, then the weights on every
        replica."""
        for i, p in enumerate(self.host):
            p.data()[:] = _checked(arrays, f"param{i}", p.shape)
        for i, (p, per_replica) in enumerate(zip(self.aux, self.aux_arrays())):
            for d, a in enumerate(per_replica):
                a[:] = _checked(arrays, _aux_key(i, d), p.shape)
        self.scatter()

    def save_global(self, net, path):
        """Write `path` as Gluon's save_parameters would for a net whose weights are the host weights and
        whose BatchNorm statistics are the first replica's (save_parameters itself would average the
        replicas' copies)."""
        host_of = {id(p): h.data() for p, h in zip(self.params, self.host)}
        arrays = {name: (host_of[id(p)] if id(p) in host_of else p.data(self.first)).as_in_context(HOST)
                  for name, p in net._collect_params_with_prefix().items()}
        mx.nd.save(path, arrays)


def _bucket_bounds(sizes, most, alone):
    """[(first, end)] parameter index ranges of at most `most` values each; a parameter of `alone` values or
    more (or of more than `most`) in a range of its own."""
    bounds, first, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > first and (total + n > most or n >= alone or sizes[i - 1] >= alone):
            bounds.append((first, i))
            first, total = i, 0
        total += n
    return bounds + [(first, len(sizes))]


class _Alone:
    """One large parameter: copied directly between its host arrays and each device."""

    def __init__(self, params, contexts, weights, grads):
        (self.param,), self.contexts = params, contexts
        self.weights, self.grads = weights.reshape(self.param.shape), grads.reshape(self.param.shape)
        self.landed = [mx.nd.zeros(self.param.shape, ctx=HOST) for _ in contexts[1:]]

    def load_first(self):
        self.param.data(self.contexts[0]).copyto(self.weights)

    def gather(self):
        self.param.grad(self.contexts[0]).copyto(self.grads)
        for c, landed in zip(self.contexts[1:], self.landed):
            self.param.grad(c).copyto(landed)
        if self.landed:
            mx.nd.add_n(self.grads, *self.landed, out=self.grads)

    def scatter(self):
        for c in self.contexts:
            self.weights.copyto(self.param.data(c))


class _Bucket:
    """Consecutive parameters that move together: their slices of the host's flat weights and gradients
    and, per device, flat views of their arrays and a flat staging vector each way."""

    def __init__(self, params, contexts, weights, grads):
        self.weights, self.grads = weights, grads
        self.device_weights = [FlatViews([p.data(c) for p in params]) for c in contexts]
        self.device_grads = [FlatViews([p.grad(c) for p in params]) for c in contexts]
        self.staged_weights = [v.buffer(mx.nd.zeros(v.size, ctx=c)) for v, c in zip(self.device_weights, contexts)]
        self.staged_grads = [v.buffer(mx.nd.zeros(v.size, ctx=c)) for v, c in zip(self.device_grads, contexts)]
        self.landed = [mx.nd.zeros(grads.size, ctx=HOST) for _ in contexts[1:]]

    def load_first(self):
        self.device_weights[0].copy_to(self.staged_weights[0])
        self.staged_weights[0].array.copyto(self.weights)

    def gather(self):
        for views, staged in zip(self.device_grads, self.staged_grads):
            views.copy_to(staged)
        # The first device's sum lands in the host gradient, the others beside it, then one sum.
        self.staged_grads[0].array.copyto(self.grads)
        for staged, landed in zip(self.staged_grads[1:], self.landed):
            staged.array.copyto(landed)
        if self.landed:
            mx.nd.add_n(self.grads, *self.landed, out=self.grads)

    def scatter(self):
        for views, staged in zip(self.device_weights, self.staged_weights):
            self.weights.copyto(staged.array)
            views.copy_from(staged)


def _aux_key(i, replica):
    """A BatchNorm statistic's name in a checkpoint: the first replica's keeps the single-device name."""
    return f"aux{i}" if replica == 0 else f"aux{i}.replica{replica}"


def _checked(arrays, key, shape):
    if key not in arrays:
        raise CheckpointError(f"checkpoint has no {key} (train.devices must match the checkpoint's)")
    saved = arrays[key]
    if saved.shape != tuple(shape):
        raise CheckpointError(f"checkpoint {key} has shape {saved.shape}, model has {tuple(shape)}")
    return saved

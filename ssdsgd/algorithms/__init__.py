"""Clients: how a worker moves gradients and weights to and from the servers (base.py: the contract).

Which client runs a config is its algorithm's registry entry's (ssdsgd.registry, where the built-ins
are declared and a plug-in registers itself); the class is imported only when a worker builds it (the
front end reads the registry and must not import mxnet). A new algorithm is one module: a base.Client
subclass registered by name (docs/design.md, "Extending: an algorithm").
"""
import os

from ssdsgd.config import runner_of
from ssdsgd.env import rank_line
from ssdsgd.registry import client_class as registered_class


def client_class(cfg):
    """The client class that runs cfg."""
    return registered_class(runner_of(cfg))


def create_kvstore(cfg):
    """The KVStore the config's client runs on (the rank is known only once it exists), once every
    worker and server has proven that it belongs to the job (ssdsgd.ps.membership)."""
    import mxnet as mx

    from ssdsgd.ps.membership import prove_worker
    cls = client_class(cfg)
    os.environ.update(cls.kvstore_environment())
    kv = mx.kv.create(cls.kvstore_type(cfg))
    print(rank_line(kv.rank), flush=True)
    if kv.type.startswith("dist"):         # a local KVStore (a client without servers) has no roll call
        prove_worker(kv)
    return kv


def make_client(cfg, kv, params, schedule, log, *, total_steps, steps_per_epoch, measure_backward=None):
    return client_class(cfg)(kv, params, cfg, schedule, log, total_steps=total_steps,
                             measure_backward=measure_backward, steps_per_epoch=steps_per_epoch)

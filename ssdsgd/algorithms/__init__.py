"""Clients: how a worker moves gradients and weights to and from the servers (base.py: the contract).

Which client runs a config is decided in one place, ssdsgd.config.client_kind; CLIENTS maps each kind
to its class, imported only when a worker builds it (this package is read by the front end, which must
not import mxnet). A new variant is one module with a base.Client subclass plus its line in CLIENTS,
and the configs it runs routed to it in client_kind (see the README, "Extending").
"""
import importlib
import os

from ssdsgd.config import ROUNDS, STOCK, client_kind
from ssdsgd.env import rank_line
from ssdsgd.ps.membership import prove_worker

CLIENTS = {
    STOCK: "ssdsgd.algorithms.stock:StockClient",       # SSGD / ASGD on MXNet's stock KVStore
    ROUNDS: "ssdsgd.algorithms.ssd:RoundClient",        # SSD-SGD and compressed SSGD on the round server
}


def client_class(cfg):
    module, _, name = CLIENTS[client_kind(cfg)].partition(":")
    return getattr(importlib.import_module(module), name)


def create_kvstore(cfg):
    """The KVStore the config's client runs on (the rank is known only once it exists), once every
    worker and server has proven that it belongs to the job (ssdsgd.ps.membership)."""
    import mxnet as mx
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

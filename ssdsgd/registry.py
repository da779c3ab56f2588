"""The algorithms a config can name (algorithm.type), registered by name, and the plug-in modules a config
imports so that its own algorithms and sparsifiers are registered before the config is checked.

An entry (Algorithm) declares what the config, the checkpoint, the idle-key notes and the training loop
need to know of an algorithm without importing its client (client modules import mxnet, which the front
end and a server must not do while reading a config): its client, as a class or as "module:Class"
resolved only when a worker builds it (ssdsgd.algorithms); the form of the servers' state its checkpoints
hold (PLANS, validated by ssdsgd.checkpoint); the algorithm.* keys it reads (the others are noted as idle,
ssdsgd.idle); and whether it starts with a synchronous warm-up (algorithm.warmup_iters).

The built-ins are declared at the end of this module. A plug-in is a module that registers itself at
import, mxnet-free (ssdsgd.algorithms.base.Client needs no mxnet at import; a client's methods reach
MXNet through the KVStore and arrays the worker hands them):

    @register_algorithm("local_sgd", plan="stock", uses=("delay",))
    class LocalSGDClient(Client): ...

and a config that uses it names the module in `plugins`: every process (the front end, the scheduler,
the servers, the workers) imports those modules first when it reads the config (import_plugins).
Sparsifiers register the same way (ssdsgd.compression.registry); one plug-in module may hold both.
"""
import importlib
import sys
from dataclasses import dataclass
from typing import Optional, Union

from ssdsgd.compression.registry import DENSE, NATIVE_2BIT, is_sparsifier

ROUNDS, STOCK = "rounds", "stock"
# The forms of the servers' state a checkpoint holds: our round server's buffers, planned by
# compression.fusion (server-buffer<b>.npz), or MXNet's stock optimizer by key (server-stock<r>.npz).
PLANS = (ROUNDS, STOCK)


@dataclass(frozen=True)
class Algorithm:
    name: str
    client: Union[type, str]            # the base.Client subclass, or "module:Class" (resolved by a worker)
    plan: str = STOCK                   # one of PLANS: what its checkpoints' servers hold
    uses: tuple = ()                    # the algorithm.* keys it reads: "delay", or a section, "local"
    warmup: bool = False                # a synchronous warm-up of algorithm.warmup_iters steps first
    # The registered algorithm whose client and plan run it when compression.type is a sparsifier (SSGD
    # then runs on the round server, as "ssd" does; its own name: its client takes sparsifiers); None:
    # it takes none.
    sparsifiers: Optional[str] = None
    compression: tuple = (DENSE,)       # the other compression.type values its client takes ("2bit")


ALGORITHMS = {}          # name -> Algorithm, in registration order
CLIENT_METHODS = ("kvstore_type", "setup", "after_backward", "global_weights")


def add_algorithm(entry):
    """Register an Algorithm; ValueError naming it on a name taken or a declaration missing."""
    where = entry.client if isinstance(entry.client, str) else f"{entry.client.__module__}.{entry.client.__name__}"
    if entry.name in ALGORITHMS:
        raise ValueError(f"algorithm {entry.name!r} ({where}): the name is already taken by "
                         f"{ALGORITHMS[entry.name].client}")
    if entry.plan not in PLANS:
        raise ValueError(f"algorithm {entry.name!r} ({where}): plan must be one of {', '.join(PLANS)}, "
                         f"got {entry.plan!r}")
    if isinstance(entry.client, str) and ":" not in entry.client:
        raise ValueError(f"algorithm {entry.name!r}: client must be a class or 'module:Class', got {entry.client!r}")
    if not isinstance(entry.uses, tuple) or not all(isinstance(k, str) for k in entry.uses):
        raise ValueError(f"algorithm {entry.name!r} ({where}): uses must be a tuple of algorithm.* key names, "
                         f"got {entry.uses!r}")
    # A class's own methods (the base's raise NotImplementedError; a path is checked when a worker imports it).
    missing = [m for m in CLIENT_METHODS if not isinstance(entry.client, str) and
               getattr(getattr(entry.client, m, None), "__qualname__", "Client.").startswith("Client.")]
    if missing:
        raise ValueError(f"algorithm {entry.name!r} ({where}): no {', '.join(missing)}; a subclass of "
                         f"ssdsgd.algorithms.base.Client implements {', '.join(CLIENT_METHODS)}")
    ALGORITHMS[entry.name] = entry
    return entry


def register_algorithm(name, **declared):
    """Class decorator: make the client class available as algorithm.type `name` (declared: the
    Algorithm fields plan, uses, warmup, sparsifiers, compression)."""
    def add(cls):
        add_algorithm(Algorithm(name, cls, **declared))
        return cls
    return add


def algorithm_names():
    """Every value algorithm.type may take."""
    return tuple(ALGORITHMS)


def runner(algorithm_type, compression_type):
    """The Algorithm whose client and plan run this pair of algorithm.type and compression.type."""
    entry = ALGORITHMS[algorithm_type]
    if is_sparsifier(compression_type) and entry.sparsifiers:
        return ALGORITHMS[entry.sparsifiers]
    return entry


def client_class(entry):
    """The client class of an Algorithm (its module imported here when the entry names it as a path)."""
    if not isinstance(entry.client, str):
        return entry.client
    module, _, name = entry.client.partition(":")
    return getattr(importlib.import_module(module), name)


class PluginError(ValueError):
    """A plug-in module that cannot be used; its message names the module."""


def import_plugins(modules):
    """Import the plug-in modules a config names (its `plugins`), each of which registers its algorithms
    or sparsifiers; already imported ones are not run again. PluginError naming the module when it
    cannot be imported, fails to register, or imports mxnet (a server reading its config must not)."""
    for name in modules:
        if name in sys.modules:
            continue
        had_mxnet = "mxnet" in sys.modules
        try:
            importlib.import_module(name)
        except ValueError as err:                    # a registration refused (a name taken, a declaration missing)
            raise PluginError(f"{name}: {err}") from None
        except ImportError as err:
            raise PluginError(f"cannot import {name}: {err}") from None
        if not had_mxnet and "mxnet" in sys.modules:
            raise PluginError(f"{name} imports mxnet when imported; every role imports it while reading its config, "
                              f"before a server may load mxnet: import mxnet inside the client's methods")


# The built-ins. Their clients are paths: their modules import mxnet.
_DELAY_STAGE = ("warmup_iters", "delay", "max_staleness", "strict", "lr_cap", "lr", "momentum", "local")
add_algorithm(Algorithm("ssgd", "ssdsgd.algorithms.stock:StockClient", STOCK, sparsifiers="ssd",
                        compression=(DENSE, NATIVE_2BIT)))
add_algorithm(Algorithm("asgd", "ssdsgd.algorithms.stock:StockClient", STOCK, compression=(DENSE, NATIVE_2BIT)))
add_algorithm(Algorithm("ssd", "ssdsgd.algorithms.ssd:RoundClient", ROUNDS, _DELAY_STAGE, warmup=True,
                        sparsifiers="ssd"))

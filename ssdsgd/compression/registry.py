"""The compression types a config can name, and the one registry of sparsifiers.

compression.type is "none" (dense pushes), "2bit" (MXNet's native compression, stock KVStore path
only) or the name of a registered sparsifier. A sparsifier is a subclass of compressor.Sparsifier
(its contract is stated there), built as `cls(seed=seed)`, registered with `@register("name")` in its
module; a built-in's module is imported by ssdsgd/compression/__init__.py (one line), a plug-in's by
the config's `plugins` (ssdsgd.registry.import_plugins), so the name is known before a config is checked.

No mxnet here, and none at import time in the sparsifiers' modules: ssdsgd.config reads the names
before any role has imported mxnet (see ssdsgd/__init__.py).
"""
DENSE = "none"
NATIVE_2BIT = "2bit"

SPARSIFIERS = {}          # name -> class, in registration order


def register(name):
    """Class decorator: make the sparsifier available as compression.type `name`."""
    def add(cls):
        if name in SPARSIFIERS or name in (DENSE, NATIVE_2BIT):
            taken = f" by {SPARSIFIERS[name].__module__}.{SPARSIFIERS[name].__name__}" if name in SPARSIFIERS else ""
            raise ValueError(f"sparsifier {name!r} ({cls.__module__}.{cls.__name__}): the compression type "
                             f"{name!r} is already taken{taken}")
        missing = [a for a in ("select", "select_buffer", "magnitudes") if not hasattr(cls, a)]
        if missing:
            raise ValueError(f"sparsifier {name!r} ({cls.__module__}.{cls.__name__}): no {', '.join(missing)}; "
                             f"subclass ssdsgd.compression.compressor.Sparsifier")
        SPARSIFIERS[name] = cls
        return cls
    return add


def is_sparsifier(kind):
    """Does compression.type `kind` push sparse (index, value) messages through the round server?"""
    return kind in SPARSIFIERS


def sparsifier_names():
    """'topk, randomk or dgc': the registered sparsifiers, for messages."""
    names = list(SPARSIFIERS)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def compression_types():
    """Every value compression.type may take."""
    return (DENSE, *SPARSIFIERS, NATIVE_2BIT)


def make_compressor(kind, seed=0):
    if not is_sparsifier(kind):
        raise ValueError(f"compression.type {kind!r} is not a sparsifier")
    return SPARSIFIERS[kind](seed=seed)

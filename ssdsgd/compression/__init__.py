"""Gradient compression on the push path (GRACE-style split: compressor, memory, codec, fusion)."""
# The built-in sparsifiers register themselves on import (registry.py); a new built-in is a module here
# and one import line below, a plug-in a module named in a config's `plugins` (ssdsgd.registry).
from ssdsgd.compression import compressor  # noqa: F401

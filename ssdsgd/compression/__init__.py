"""Gradient compression on the push path (GRACE-style split: compressor, memory, codec, fusion)."""
# The built-in sparsifiers register themselves on import (registry.py); a new one is a module here
# and one import line below.
from ssdsgd.compression import compressor  # noqa: F401

"""Gradient compression on the push path (GRACE-style split: compressor, memory, codec, fusion)."""

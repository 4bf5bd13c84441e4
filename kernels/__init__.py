"""TileLang kernels for GDN chunked prefill, installed as ``flashqla.kernels``.

Nothing here compiles or touches a GPU at import time; builders compile on first use (or load from the
TileLang cache).
"""

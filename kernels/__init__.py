"""TileLang kernels for GDN chunked prefill, installed as ``flashqla.kernels``.

Nothing here compiles or touches a GPU at import time; builders compile on first use (or load from the
TileLang cache).
"""
import os


def switched_on(env: str) -> bool:
    """An on-by-default switch: False only when the environment variable `env` says 0/off/false/no. The one
    reading of flashqla's FLASHQLA_* switches, here at the bottom layer so that the kernels' host code (e.g.
    FLASHQLA_GQA_PAIR_SUM) and flashqla.ops (re-exported by flashqla.ops.backends) read them alike."""
    return os.environ.get(env, "1").strip().lower() not in ("0", "off", "false", "no")

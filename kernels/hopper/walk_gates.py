"""The gate rows a walk's loader warp stores for one chunk (fused_fwd.py, chunk_dstates.py).

Row r of the chunk starting at token t0 gets the gates of token t0 + min(r, last_row), last_row = the
chunk's last row inside its sequence: the rows past a sequence's end repeat its last gate, so every decay
factor that reaches them is 1 and the consumers index the rows directly. The cumulative gate is stored in
base 2 (for exp2) and beta as it is.
"""
import tilelang.language as T

CHUNK = 64
LOG2E = 1.4426950408889634


@T.macro
def load_gate_rows(gcum, beta, g_s, b_s, stage, h, t0, last_row):
    """g_s[stage, r] = log2(e) gcum[h, t] and b_s[stage, r] = beta[t, h], t = t0 + min(r, last_row)."""
    for r in T.Parallel(CHUNK):
        token = t0 + T.min(r, last_row)
        g_s[stage, r] = gcum[h, token] * LOG2E
        b_s[stage, r] = beta[token, h]

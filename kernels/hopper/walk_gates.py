"""The gate rows a walk's loader warp stores for one chunk (fused_fwd.py, chunk_dstates.py).

Row r of the chunk starting at token t0 gets the gates of token t0 + min(r, last_row), last_row = the
chunk's last row inside its sequence: the rows past a sequence's end repeat its last gate, so every decay
factor that reaches them is 1 and the consumers index the rows directly. The cumulative gate is stored in
base 2 (for exp2) and beta as it is.

`load_gate_rows` loads and stores in one go (chunk_dstates). `gate_rows_to_regs` / `gate_regs_to_shared`
split it, so fused_fwd's loader loads the next chunk's gates right after a chunk's `ready` arrival and their
latency passes while it waits for its next stage (its loop is serial; a load waited for in place costs
every chunk that latency). Against the k-head variable alone in fused_fwd (docs/kernels.md, "Fifty-fourth
session", H100): level at V tile 32, at 128 1.067x at (16, 32) 4K x 8 and within 1.2% either way elsewhere. In
chunk_dstates the same split was 2-5% slower at V tiles 32 and 128, so that walk keeps `load_gate_rows`.
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


@T.macro
def gate_rows_to_regs(gcum, beta, g_r, b_r, h, t0, last_row, lane):
    """Loader lane `lane` (0-31): g_r[i] = gcum[h, t], b_r[i] = beta[t, h] of row r = 32 i + lane,
    t = t0 + min(r, last_row) (registers, two rows per lane)."""
    for i in T.unroll(CHUNK // 32):
        token = t0 + T.min(i * 32 + lane, last_row)
        g_r[i] = gcum[h, token]
        b_r[i] = beta[token, h]


@T.macro
def gate_regs_to_shared(g_r, b_r, g_s, b_s, stage, lane):
    """The rows gate_rows_to_regs loaded, to g_s[stage] (base 2) and b_s[stage] as load_gate_rows stores them."""
    for i in T.unroll(CHUNK // 32):
        g_s[stage, i * 32 + lane] = g_r[i] * LOG2E
        b_s[stage, i * 32 + lane] = b_r[i]

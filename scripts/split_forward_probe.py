"""What the split CP-off forward's kernels take alone and side by side (CUDA graphs, us, prebuilt kernels only):

    python3 scripts/split_forward_probe.py 2:8:32768 16:16:32768     # Hqk:Hv:tokens, one sequence each

Per config: the fused forward (`chunk_gdn_fwd(fused=True)`, CP off) and the split one (`fused=False`), then the
split forward's launches alone on the arguments it passed them: `wy_inverse`, `chunk_states` (the walk storing the
state entering every chunk and V') and `chunk_output` (O of every chunk at once), and the last two one after the
other and side by side on two streams (the output's inputs all there before it starts). Side by side bounds what
sharing the GPU costs the walk: the question before an output launch that runs beside the walk on the SMs it leaves
idle (docs/kernels.md, "Sixty-fifth session").
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

from ab_kernel import graph_time_us, record_launch  # noqa: E402
from bench_gdn import make_inputs  # noqa: E402
from flashqla.kernels.hopper.backward import side_by_side  # noqa: E402

# the builds each kernel may be launched with (the first one the split forward launched is timed)
BUILDS = (("wy_inverse", [("bfloat16", shared_k, copy_beta) for shared_k in (True, False) for copy_beta in (True, False)]),
          ("chunk_states", [("bfloat16", block_v) for block_v in (32, 64, 128)]),
          ("chunk_output", [("bfloat16",)]))


def probe(hqk, hv, tokens):
    from flashqla.kernels.hopper import chunk_gdn_fwd

    q, k, v, g, beta, cu = make_inputs(hqk, hv, [tokens])
    g = g.float()
    split = lambda: chunk_gdn_fwd(q, k, v, g, beta, 128 ** -0.5, None, False, cu, fused=False)  # noqa: E731
    fused = lambda: chunk_gdn_fwd(q, k, v, g, beta, 128 ** -0.5, None, False, cu, fused=True)  # noqa: E731
    line = [f"({hqk}, {hv}) 1 x {tokens}: fused {graph_time_us(fused):.1f}, split {graph_time_us(split):.1f}"]
    recorded = {}
    for kernel, builds in BUILDS:
        for build in builds:
            try:
                compiled, args = record_launch(kernel, build, split)
            except RuntimeError:  # not launched with this build
                continue
            recorded[kernel] = lambda compiled=compiled, args=args: compiled(*args)
            line.append(f"{kernel}{build[1:]} {graph_time_us(recorded[kernel]):.1f}")
            break
    walk, output = recorded["chunk_states"], recorded["chunk_output"]
    line.append(f"walk then output {graph_time_us(lambda: (walk(), output())):.1f}")
    both = lambda: side_by_side(q.device, lambda: (output(),), walk)  # noqa: E731
    line.append(f"side by side {graph_time_us(both):.1f}")
    return "; ".join(line)


def main():
    for spec in sys.argv[1:]:
        print(probe(*(int(x) for x in spec.split(":"))), flush=True)


if __name__ == "__main__":
    main()

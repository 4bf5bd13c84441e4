"""docs/unlanded/gates_in_walks.patch applied (and the kernels repacked), on the device from the repo root:
    python3 docs/unlanded/gates_in_walks_ab.py
The summary walks computing their own gate statistics (HEAD: `summaries_from_gates`) against the separate
`segment_gates` launch before them (the previous `_segment_summaries`), the public op with AutoCP in CUDA graphs,
forward and fwd+bwd, interleaved rounds, one process; outputs of the two compared bitwise."""
import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_gdn  # noqa: E402
from flashqla.cp import segments  # noqa: E402

CONFIGS = [(2, 8, [32768]), (2, 8, [16384]), (2, 8, [24576, 8192]), (4, 16, [32768]), (4, 16, [16384]),
           (8, 24, [32768]), (16, 16, [32768]), (32, 32, [32768])]
folded = segments._segment_summaries


def separate(hopper, x, idx, cp_warmup, has_h0, dht_given=None, leaving=False):
    threshold = -float("inf") if cp_warmup is None else cp_warmup
    exact, active = hopper.segment_masks(x.gcum, idx.cu, idx.gate_flags(has_h0, dht_given, leaving), threshold)
    S_star, M = hopper.summaries(x, with_transition=True, active=active)
    return S_star, M, exact


run = bench_gdn.impl_flashqla_autocp()
for Hqk, Hv, lengths in CONFIGS:
    inputs = bench_gdn.make_inputs(Hqk, Hv, lengths)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs[:5]]
    do = torch.randn_like(inputs[2])

    def fwd_bwd():
        o = run(*leaves, inputs[5])[0]
        return torch.autograd.grad(o, leaves, do)

    graphs, outs = {}, {}
    for name, fn in (("separate", separate), ("folded", folded)):
        segments._segment_summaries = fn
        outs[name] = [run(*inputs)[0].clone()] + [g.clone() for g in fwd_bwd()]
        graphs[name] = bench_gdn.captured_graph(lambda: run(*inputs))
        graphs[name + "+bwd"] = bench_gdn.captured_graph(fwd_bwd)
    segments._segment_summaries = folded
    times = {name: [] for name in graphs}
    for _ in range(6):
        for name, graph in graphs.items():
            for _ in range(5):
                graph.replay()
            for _ in range(20):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                stop.record()
                stop.synchronize()
                times[name].append(start.elapsed_time(stop))
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    same = all(torch.equal(a, b) for a, b in zip(outs["separate"], outs["folded"]))
    print(f"({Hqk}, {Hv}) {bench_gdn.sequences_label(lengths)}: fwd separate {med['separate']:.1f} us, folded "
          f"{med['folded']:.1f} ({med['separate'] / med['folded']:.3f}x); fwd+bwd {med['separate+bwd']:.1f} -> "
          f"{med['folded+bwd']:.1f} ({med['separate+bwd'] / med['folded+bwd']:.3f}x); o and grads bitwise equal: {same}",
          flush=True)

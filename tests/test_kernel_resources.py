"""scripts/kernel_resources.py's static checks of generated CUDA, on hand-written sources shaped like TileLang's
output (the compile test applies them to every real kernel)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from kernel_resources import barriers_in_elected_branches  # noqa: E402

# a TMA issue in a loop, as TileLang 0.1.15 generated it for the persistent chunk_bwd_local variant: the
# storage-sync pass put the gradients warpgroup's barrier inside the branch one thread takes
ELECTED_WITH_BARRIER = """\
    } else {
      if (has_next) {
        if (tl::tl_shuffle_elect<128>()) {
          k_full[(1 - (it & 1))].expect_transaction(16384);
          #pragma unroll
          for (int i_36 = 0; i_36 < 2; ++i_36) {
            tl::__sync_thread_partial(4, 128);
            tl::tma_load(k_desc, k_full[(1 - (it & 1))], K_s, (i_36 * 64), t0_2, hv);
          }
        }
        k_full[(1 - (it & 1))].arrive();
      }
      tl::__sync_thread_partial(4, 128);
"""

# the same issue with the barrier before the branch, and a thread-0 branch holding only an mbarrier arrive
BARRIER_OUTSIDE = """\
      tl::__sync_thread_partial(4, 128);
      if (tl::tl_shuffle_elect<128>()) {
        q_full[0].expect_transaction(16384);
        tl::tma_load(q_desc, q_full[0], Q_s, 0, t0, hv);
      }
      q_full[0].arrive();
      if (((int)threadIdx.x) == 0) {
        done[0].arrive();
      }
      __syncthreads();
"""


def test_a_barrier_inside_a_one_thread_branch_is_found_with_its_line():
    assert barriers_in_elected_branches(ELECTED_WITH_BARRIER) == [(7, "tl::__sync_thread_partial(4, 128);")]
    thread_zero = "if (((int)threadIdx.x) == 0) {\n  x = 1;\n  {\n    __syncthreads();\n  }\n}\n__syncthreads();\n"
    assert barriers_in_elected_branches(thread_zero) == [(4, "__syncthreads();")]


def test_barriers_outside_one_thread_branches_pass():
    assert barriers_in_elected_branches(BARRIER_OUTSIDE) == []

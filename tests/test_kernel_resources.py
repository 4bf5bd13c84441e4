"""scripts/kernel_resources.py's static checks of generated CUDA, on hand-written sources shaped like TileLang's
output (the compile test applies them to every real kernel)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from kernel_resources import (barrier_hazards, barriers_in_unrolled_loops, dynamic_divisions_in_loops,  # noqa: E402
                              launch_shared_memory, sass_counts)

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

# a per-row register fragment to which TileLang's layout inference gave half the threads (the former chunk_w
# with beta gamma read into registers): the storage-sync pass then put a CTA-wide barrier inside the half's branch
HALF_CTA_WITH_BARRIER = """\
    beta_gamma[0] = ((float*)beta_gamma_sh)[(((int)threadIdx.x) & 63)];
    if ((((int)threadIdx.x) >> 6) == 0) {
      #pragma unroll
      for (int i_2 = 0; i_2 < 16; ++i_2) {
        bfloat16_t K_sh_local_cast[8];
        __syncthreads();
        *(uint4*)(K_sh_local_cast + 0) = *(uint4*)(((bfloat16_t*)K_sh) + i_2 * 512);
      }
    } else {
      __syncthreads();
    }
    __syncthreads();
"""

# the same TMA issue with the barrier before the branch, a thread-0 branch holding only an mbarrier arrive, and
# role branches (warpgroups) with their own named barriers
BARRIER_OUTSIDE = """\
    if (((int)threadIdx.x) < 128) {
      tl::__sync_thread_partial(3, 128);
    } else {
      tl::__sync_thread_partial(4, 128);
      if (tl::tl_shuffle_elect<128>()) {
        q_full[0].expect_transaction(16384);
        tl::tma_load(q_desc, q_full[0], Q_s, 0, t0, hv);
      }
      q_full[0].arrive();
    }
    if (((int)threadIdx.x) == 0) {
      done[0].arrive();
    }
    __syncthreads();
"""


def test_a_barrier_inside_a_one_thread_branch_is_found_with_its_line():
    one = "inside a branch one thread takes"
    assert barrier_hazards(ELECTED_WITH_BARRIER) == [(7, "tl::__sync_thread_partial(4, 128);", one)]
    thread_zero = "if (((int)threadIdx.x) == 0) {\n  x = 1;\n  {\n    __syncthreads();\n  }\n}\n__syncthreads();\n"
    assert barrier_hazards(thread_zero) == [(4, "__syncthreads();", one)]


def test_a_cta_barrier_inside_a_branch_on_the_thread_index_is_found_in_either_arm():
    why = "a CTA-wide barrier inside a branch on the thread index"
    assert barrier_hazards(HALF_CTA_WITH_BARRIER) == [(6, "__syncthreads();", why), (10, "__syncthreads();", why)]


def test_barriers_every_waited_thread_reaches_pass():
    assert barrier_hazards(BARRIER_OUTSIDE) == []


# a TMA load written inside `if tx == 0` (a segment_chain variant, thirty-fourth session): TileLang still wraps the
# issue in its warp-wide election, which only thread 0 reaches
ELECTION_IN_THREAD_ZERO = """\
    if (((int)threadIdx.x) == 0) {
      if (tl::tl_shuffle_elect<1>()) {
        m_full[0].expect_transaction(65536);
        tl::tma_load(mats_desc, m_full[0], M_s, 0, 0, row);
      }
    }
"""


def test_a_warp_election_inside_a_one_thread_branch_is_found():
    why = "a warp-wide election (elect.sync) inside a branch one thread takes"
    assert barrier_hazards(ELECTION_IN_THREAD_ZERO) == [(2, "if (tl::tl_shuffle_elect<1>()) {", why)]


def test_a_barrier_in_every_step_of_an_unrolled_pass_is_found():
    # the TMA issue above: its box loop is unrolled, the barrier in it is found by both checks
    assert barriers_in_unrolled_loops(ELECTED_WITH_BARRIER) == [(7, "tl::__sync_thread_partial(4, 128);")]
    per_row = """\
    #pragma unroll
    for (int i = 0; i < 32; ++i) {
      tl::__sync_thread_partial(3, 128);
      V_s[i * 128 + threadIdx.x] = beta_sh[i] * KS[i];
    }
    tl::__sync_thread_partial(3, 128);
    for (int c = 0; c < n_chunks; ++c) {
      tl::__sync_thread_partial(3, 128);
    }
"""
    # the rolled loop (a walk over chunks) and the barrier after the pass are not findings
    assert barriers_in_unrolled_loops(per_row) == [(3, "tl::__sync_thread_partial(3, 128);")]
    assert barriers_in_unrolled_loops(BARRIER_OUTSIDE) == []


def host_launch(values):
    """The tail of a TileLang host launch: its integer arguments, then the terminator and the handle lookup."""
    lines = [f"  (((TVMFFIAny*)stack_ffi_any)[{i}].v_int64) = ((int64_t){v});" for i, v in enumerate(values)]
    return "\n".join(lines + ["  (((TVMFFIAny*)stack_ffi_any)[99].v_int64) = (int64_t)0;",
                               "  if (k_kernel_packed == NULL) {"])


def test_dynamic_shared_memory_is_the_argument_after_the_block_or_none():
    # persistent grid (132, 1, 1), block (256, 1, 1), 217408 bytes: not a multiple of 256
    assert launch_shared_memory(host_launch([16384, 32768, 132, 1, 1, 256, 1, 1, 217408]), 256) == 217408
    # grid (2, 128, 1) whose 128 is no block; no dynamic shared memory: the argument is left out
    assert launch_shared_memory(host_launch([2, 128, 1, 128, 1, 1]), 128) == 0


# a few lines of `cuobjdump -sass` output (sm_90a, CUDA 13): predicated and unpredicated instructions, with their
# encodings on the following lines
SASS = """\
        /*0c70*/                   LDS R89, [R157+0x35400] ;                         /* 0x035400009d597984 */
                                                                                     /* 0x000e240000000800 */
        /*0c80*/              @!P6 BRA 0x7f45d682c520 ;                              /* 0x000000a000006947 */
                                                                                     /* 0x000fea000383ffff */
        /*0c90*/                   MUFU.EX2 R15, R15 ;                               /* 0x0000000f000f7308 */
        /*0ca0*/               @P0 LDL R2, [R1+0x8] ;                                /* 0x0000080001020983 */
        /*0cb0*/                   STL [R1+0x4], R3 ;                                /* 0x0000040301007387 */
        /*0cc0*/                   BSSY B1, 0x7f45d6810000 ;                         /* 0x0000000000017945 */
        /*0cd0*/                   FADD.FTZ R15, -R15, R16 ;                         /* 0x000000100f0f7221 */
"""


def test_sass_counts_read_every_instruction_and_its_kind():
    counts = sass_counts(SASS)
    assert counts == {"instructions": 7, "branches": 1, "BSSY": 1, "MUFU": 1, "shared loads": 1, "spill loads": 1,
                      "spill stores": 1}


# a loader loop as TileLang 0.1.15 generated it for fused_fwd with the k-head written as an expression (TVM's floor
# division of dynamic sizes inside the loop), beside a division by a constant and one before the loop
LOADER_WITH_DIVISIONS = """\
    int group = (num_v_heads / num_qk_heads);
    for (int c_4 = 0; c_4 < ((seq_len + 63) >> 6); ++c_4) {
      free[(c_4 % 3)].wait((((c_4 / 3) + 1) & 1));
      if (tl::tl_shuffle_elect<32>()) {
        #pragma unroll
        for (int i_25 = 0; i_25 < 2; ++i_25) {
          int rmod = (num_v_heads % num_qk_heads);
          int rdiv_2 = (((int)blockIdx.z) / hk_group);
          tl::tma_load(k_desc, ready[(c_4 % 3)], K_s, (i_25 * 64), ((c_4 * 64) + t0), (((int)blockIdx.z) / (num_v_heads / num_qk_heads)));
        }
      }
    }
    hk = (((int)blockIdx.z) / group);
"""


def test_dynamic_divisions_inside_loops_are_found_and_constant_or_hoisted_ones_are_not():
    found = dynamic_divisions_in_loops(LOADER_WITH_DIVISIONS)
    assert [number for number, _ in found] == [7, 8, 9]
    assert "rmod" in found[0][1] and "rdiv_2" in found[1][1] and "tma_load" in found[2][1]

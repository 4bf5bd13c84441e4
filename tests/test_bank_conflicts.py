"""scripts/bank_conflicts.py on small hand-written kernels whose shared-memory wavefronts are known."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import bank_conflicts  # noqa: E402

HEAD = """extern "C" __global__ void __launch_bounds__(128, 1) k(float* __restrict__ out) {
  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];
  void* V_s = ((void*)((char*)buf_dyn_shmem + 0));
  void* X_sh = ((void*)((char*)buf_dyn_shmem + 16384));
"""


def analyse(body: str, tmp_path) -> list:
    path = tmp_path / "k.cu"
    path.write_text(HEAD + body + "}\n")
    return [r for r in bank_conflicts.report(str(path), top=10, show_all=True)]


def ways(result) -> float:
    return result.wavefronts / result.ideal


def test_accumulator_fragment_into_row_major_tile_is_8_way(tmp_path):
    # an m16n8 accumulator's pair of bf16 columns, 8 rows of 128 bytes at once: the same 4 banks for every row
    body = """  for (int i = 0; i < 8; ++i) {
    *(uint1*)(V_local + 0) = *(uint1*)(((bfloat16_t*)V_s) + ((((((int)threadIdx.x) >> 5) * 1024) + (((((int)threadIdx.x) & 31) >> 2) * 64)) + (i * 8) + ((((int)threadIdx.x) & 3) * 2)));
  }
"""
    (result,) = analyse(body, tmp_path)
    assert not result.access.store and result.access.width == 4
    assert ways(result) == 8
    assert result.weight == 1.0 and result.requests == 8 * 4  # 8 loop steps x 4 warps


def test_the_same_fragment_into_a_128_byte_swizzled_tile_is_conflict_free(tmp_path):
    # the 16-byte chunk index XOR-ed with the row (mod 8), as make_swizzled_layout lays a tile of 128-byte rows
    body = """  for (int i = 0; i < 8; ++i) {
    *(uint1*)(((bfloat16_t*)V_s) + ((((((int)threadIdx.x) >> 5) * 1024) + (((((int)threadIdx.x) & 31) >> 2) * 64)) + ((((i) ^ ((((int)threadIdx.x) & 31) >> 2)) & 7) * 8) + ((((int)threadIdx.x) & 3) * 2))) = *(uint1*)(V_local + 0);
  }
"""
    (result,) = analyse(body, tmp_path)
    assert result.access.store
    assert ways(result) == 1


def test_vector_widths_are_served_in_half_and_quarter_warps(tmp_path):
    body = """  *(float4*)(acc + 0) = *(float4*)(((float*)X_sh) + (((int)threadIdx.x) * 4));
  *(float2*)(acc + 0) = *(float2*)(((float*)X_sh) + (((int)threadIdx.x) * 2));
  *(float4*)(acc + 0) = *(float4*)(((float*)X_sh) + (((int)threadIdx.x) * 8));
"""
    dense4, dense2, strided4 = analyse(body, tmp_path)
    assert (dense4.wavefronts, dense4.ideal) == (4 * 4, 4 * 4)  # 4 quarter-warps of 128 bytes, 4 warps
    assert (dense2.wavefronts, dense2.ideal) == (2 * 4, 2 * 4)
    assert ways(strided4) == 2  # a quarter-warp's 8 rows of 32 bytes span 256 bytes: two per bank


def test_broadcast_guards_and_the_ldmatrix_operand(tmp_path):
    body = """  if (((int)threadIdx.x) < 64) {
    float b = ((float*)X_sh)[0];
    ((float*)X_sh)[(((int)threadIdx.x) * 32)] = b;
  } else {
    ((float*)X_sh)[((int)threadIdx.x)] = 0x0p+0f;
  }
  tl::ptx_ldmatrix_x4((&(((bfloat16_t*)V_s)[((((int)threadIdx.x) & 7) * 64)])), (&(A_local[0])));
  tl::tma_load(v_desc, ready[0], (&(((bfloat16_t*)V_s)[0])), 0, 0);
"""
    broadcast, column, other_half, ldmatrix = analyse(body, tmp_path)
    assert broadcast.requests == 2 and ways(broadcast) == 1  # two warps pass the guard, one word for all
    assert column.requests == 2 and ways(column) == 32  # a column of a row-major fp32 tile: one bank
    assert other_half.requests == 2 and ways(other_half) == 1  # the `else`: warps 2 and 3
    assert ldmatrix.access.width == 16 and ways(ldmatrix) == 8  # 8 rows of 128 bytes, 16 bytes each: one bank group


def test_runtime_loop_bounds_and_values_do_not_stop_the_analysis(tmp_path):
    body = """  for (int c = 0; c < ((seq_len + 63) >> 6); ++c) {
    ((float*)X_sh)[(((c & 1) * 4096) + ((int)threadIdx.x))] = ((float*)out)[c];
  }
"""
    (result,) = analyse(body, tmp_path)
    assert result.weight == 1.0 and result.requests == bank_conflicts.DYNAMIC_STEPS * 4
    assert ways(result) == 1


@pytest.mark.parametrize("width,lanes,expected", [(4, range(32), 1), (8, range(32), 2), (16, range(32), 4)])
def test_request_wavefronts_of_dense_accesses(width, lanes, expected):
    addresses = [lane * width for lane in lanes]
    assert bank_conflicts.request_wavefronts(addresses, width) == (expected, expected)

"""scripts/ncu_regions.py on a hand-written listing shaped like `ncu --page source --csv --print-source sass`."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from ncu_regions import opcode, read_listing, regions_of, report  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"L1 Wavefronts Shared","L1 Wavefronts Shared Ideal"')
ROWS = [  # (instruction, samples, executed, wavefronts, ideal)
    ("LDC R1, c[0x0][0x28]", 10, 4, 0, 0),
    ("STS [R2], R3", 30, 8, 16, 8),  # a 2-way conflicted store
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 20, 4, 0, 0),
    ("@!P0 LDS.128 R4, [R2]", 40, 8, 8, 8),
    ("FFMA R4, R4, R5, R6", 0, 0, 0, 0),  # never executed
    ("@P1 EXIT", 0, 4, 0, 0),
    ("BRA 0x0", 0, 0, 0, 0),
]


def listing():
    lines = ['"Kernel Name","demo_kernel",', HEADER]
    lines += [f'"0x{n:x}","      {text}","{s}","{e}","{w}","{i}"' for n, (text, s, e, w, i) in enumerate(ROWS)]
    return "\n".join(lines)


def test_regions_end_at_barriers_and_exits():
    regions = regions_of(read_listing(listing()))
    assert [(r.first, r.last) for r in regions] == [(0, 2), (3, 5), (6, 6)]
    first, second, tail = regions
    assert (first.samples, first.executed, first.wavefronts, first.ideal) == (60, 16, 16, 8)
    assert first.closing.startswith("BAR.SYNC") and second.closing == "EXIT"
    assert second.opcodes == {"LDS": 8, "EXIT": 4} and tail.executed == 0


def test_report_gives_shares_per_cta_and_leaves_out_unexecuted_regions():
    lines = report(regions_of(read_listing(listing())), ctas=4)
    assert len(lines) == 3  # the header and the two executed regions
    assert "60.0%" in lines[1] and "50%" in lines[1] and "STS 2" in lines[1]  # 2-way: half of ideal
    assert "40.0%" in lines[2] and "100%" in lines[2]


def test_opcode_drops_predicate_and_modifiers():
    assert opcode("@!P0 LDS.128 R4, [R2]") == "LDS" and opcode("HGMMA.64x32x16.F32 gdesc") == "HGMMA"

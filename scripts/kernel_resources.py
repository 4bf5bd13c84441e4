"""Registers, shared memory and CTAs per SM of a TileLang kernel built here for sm_90a (no GPU needed).

    .venv/bin/python scripts/kernel_resources.py wy_inverse build_wy_inverse bfloat16 True True
    .venv/bin/python scripts/kernel_resources.py path/to/variant.py build_wy_inverse bfloat16 True True
    .venv/bin/python scripts/kernel_resources.py --source out.cu chunk_bwd_local build_chunk_bwd_local bfloat16
    .venv/bin/python scripts/kernel_resources.py --sass out.sass chunk_bwd_local build_chunk_bwd_local bfloat16

The first argument is a module of flashqla.kernels.hopper or a file holding a variant of one; the rest is
the builder and its arguments (integers where they look like integers). Prints the registers per thread
(read from the cubin TileLang wrote), the dynamic shared memory and where each shared buffer starts
(TileLang's planner lays buffers with disjoint lifetimes over each other), ptxas's spill stores and loads and
its wgmma serialisation (every product waited for as soon as issued),
the 64-bit integer divisions in the PTX (each a call of a division routine in SASS), the barriers inside
fully unrolled loops (one per step of an elementwise pass),
how many CTAs of it fit on one H200 SM by registers and by shared memory (the occupancy Nsight Compute would
report, before any device time is spent; docs/kernels.md, "Occupancy"), and every thread barrier the generated
CUDA places where not all the threads it waits for can reach it (a hang on the device). `--source FILE` also
writes the CUDA source TileLang generated, to read what a step lowered to. `--sass FILE` writes the cubin's SASS
(`cuobjdump -sass`; cuobjdump and nvdisasm are not part of nvcc's install here, but PyPI's
`nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels hold them: unzip both, put their `nvidia/cu13/bin` on
PATH) and prints its instruction counts: every instruction, branches, MUFU, shared loads, local-memory spill
traffic.
"""
from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

# H200 (SM90) per-SM limits
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_CTA = 1024
MAX_WARPS_PER_SM = 64


def load_builder(target: str, builder: str):
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location("flashqla.kernels.hopper._variant", target)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = "flashqla.kernels.hopper"  # a copied kernel's relative imports still resolve
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(f"flashqla.kernels.hopper.{target}")
    return getattr(module, builder)


def kernel_module(target: str, builder: str) -> str | None:
    """The kernel module whose pass configs (launch.MODULE_PASS_CONFIGS) a build of `builder` from `target`
    takes: the module `target` names, or for a variant file the module its builder names (`build_<module>`),
    so that a variant is built as the committed kernel is."""
    if not target.endswith(".py"):
        return target
    return builder[len("build_"):] if builder.startswith("build_") else None


def parse_build_args(raw) -> tuple:
    """Command-line builder arguments: integers where they look like integers, True/False as bools."""
    return tuple(int(a) if a.lstrip("-").isdigit() else {"True": True, "False": False}.get(a, a) for a in raw)


# any branch on the thread index (a role's, or part of a tile's threads)
THREAD_BRANCH = re.compile(r"^\s*(\} else )?if \(.*threadIdx")
THREAD_BARRIER = re.compile(r"__syncthreads\(\)|__sync_thread_partial\(|\bbar\.sync\b|\bbarrier\.sync\b")
# a branch only thread N takes, and TileLang's TMA election (cute::elect_one_sync: elect.sync over the full warp)
ONE_THREAD_BRANCH = re.compile(r"if \(\(\(int\)threadIdx\.x\) == \d+\)")
WARP_ELECTION = re.compile(r"tl::tl_shuffle_elect<\d+>\(\)")
# the one-thread branches TileLang emits around a TMA issue (T.tma_copy, T.copy through TMA) or a thread-0 step
ELECTED_BRANCH = re.compile(rf"if \({WARP_ELECTION.pattern}\)|{ONE_THREAD_BRANCH.pattern}")


def _lines_in_blocks(source: str, block_kind):
    """(line number, line, kinds of the enclosing blocks) for every line of generated CUDA that opens none of the
    blocks `block_kind(line, previous line)` names (None: not one of them). Reads the brace structure TileLang's
    code generator writes: `{` ends the line that opens a block, one `}` per line (`} else if (...) {` opens its
    arm at the chain's own depth)."""
    open_blocks, depth, previous = [], 0, ""
    for number, line in enumerate(source.splitlines(), 1):
        kind = block_kind(line, previous)
        if kind:
            open_blocks.append((depth - line.lstrip().startswith("}"), kind))
        else:
            yield number, line, [kind for _, kind in open_blocks]
        depth += line.count("{") - line.count("}")
        while open_blocks and depth <= open_blocks[-1][0]:
            open_blocks.pop()
        previous = line.strip()


def _thread_branch(line, previous):
    return "elected" if ELECTED_BRANCH.search(line) else "threads" if THREAD_BRANCH.search(line) else None


def _one_thread_branch(line, previous):
    return "one thread" if ONE_THREAD_BRANCH.search(line) else None


def _unrolled_loop(line, previous):
    return "unrolled" if previous == "#pragma unroll" and line.lstrip().startswith("for (") else None


def barrier_hazards(source: str) -> list[tuple[int, str, str]]:
    """(line number, line, why) of every thread barrier in the generated CUDA that waits for threads which
    cannot reach it: any barrier inside a branch one thread takes, and a CTA-wide `__syncthreads()` inside any
    branch on the thread index (an `else` included). Such a barrier hangs the kernel, or completes with the
    arrivals of another barrier. TileLang 0.1.15 generates both: its storage-sync pass puts a barrier inside the
    one-thread TMA branch when the load's coordinates read shared memory written elsewhere in the loop, and
    inside a half-CTA branch when a per-row register fragment gets a layout that leaves half the threads idle
    (docs/kernels.md, "Thirtieth session"). Also every TMA election (`tl_shuffle_elect`, an elect.sync whose
    member mask is the whole warp) inside a branch one thread takes: the other 31 lanes never execute it, which
    is undefined behaviour for a .sync instruction (a `T.tma_copy` written inside `if tx == 0`)."""
    found = [(number, line.strip(), "a warp-wide election (elect.sync) inside a branch one thread takes")
             for number, line, inside in _lines_in_blocks(source, _one_thread_branch)
             if inside and WARP_ELECTION.search(line)]
    for number, line, inside in _lines_in_blocks(source, _thread_branch):
        if not THREAD_BARRIER.search(line):
            continue
        if "elected" in inside:
            found.append((number, line.strip(), "inside a branch one thread takes"))
        elif inside and "__syncthreads()" in line:
            found.append((number, line.strip(), "a CTA-wide barrier inside a branch on the thread index"))
    return found


def barriers_in_unrolled_loops(source: str) -> list[tuple[int, str]]:
    """(line number, line) of every thread barrier inside a fully unrolled loop (`#pragma unroll` before the
    `for`) of the generated CUDA: a barrier in every step of what is usually an elementwise pass over a tile.
    TileLang's storage-sync pass puts one there when such a pass reads a small shared array (a per-row scale)
    it cannot prove unchanged between steps: 125 barriers against 34 in a `chunk_bwd_local` variant
    (docs/kernels.md, "Twenty-ninth session"). Not always wrong (an in-place pass whose threads' read and write
    layouts differ needs it), but never cheap."""
    return [(number, line.strip()) for number, line, inside in _lines_in_blocks(source, _unrolled_loop)
            if inside and THREAD_BARRIER.search(line)]


# an integer division or remainder by one of the kernel's dynamic sizes (TileLang names them num_*), or the
# temporaries of TVM's floor-division lowering
DYNAMIC_DIVISION = re.compile(r"[/%] \(*(\(int\))?num_\w+|\bint r(div|mod)(_\d+)? =")


def _loop(line, previous):
    return "loop" if line.lstrip().startswith("for (") else None


def dynamic_divisions_in_loops(source: str) -> list[tuple[int, str]]:
    """(line number, line) of every integer division or remainder by a dynamic size inside a loop of the
    generated CUDA. An index expression written once in a kernel (a GQA k-head `h // (Hv // Hqk)`) is expanded
    into every use, so it is recomputed wherever it is used in a loop: in fused_fwd's loader, two divisions
    and two remainders per TMA box and chunk on the walk's one serial warp, which set the V-tile-32 walk's pace
    (docs/kernels.md, "Fifty-fourth session"). A variable set once outside the loop holds it instead."""
    return [(number, line.strip()) for number, line, inside in _lines_in_blocks(source, _loop)
            if inside and DYNAMIC_DIVISION.search(line)]


def launch_shared_memory(host: str, threads: int) -> int:
    """Dynamic shared memory of the kernel's launch in TileLang's host code: the launch's integer arguments end
    with the block (threads, 1, 1) and then the dynamic shared memory, left out when there is none."""
    launch_args = host.split("_kernel_packed == NULL")[0]
    values = [int(x) for x in re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\)", launch_args)]
    blocks = [i for i in range(len(values) - 2) if values[i:i + 3] == [threads, 1, 1]]
    return values[blocks[-1] + 3] if blocks and blocks[-1] + 3 < len(values) else 0


def cubin_registers(path: str) -> int | None:
    """Registers per thread of the kernel in a cubin: the EIATTR_REGCOUNT record (attribute 0x2f, format
    EIFMT_SVAL) of its .nv.info section, what `cuobjdump --dump-resource-usage` prints as REG."""
    data = open(path, "rb").read()
    table, entry_size, count, names_index = struct.unpack_from("<Q", data, 0x28)[0], *struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, table + i * entry_size) for i in range(count)]
    names = sections[names_index][4]
    for name, _, _, _, offset, size, *_ in sections:
        if data[names + name:data.index(b"\0", names + name)] != b".nv.info":
            continue
        at = offset
        while at < offset + size:
            fmt, attribute = data[at], data[at + 1]
            length = struct.unpack_from("<H", data, at + 2)[0] if fmt == 0x04 else 0  # EIFMT_SVAL: sized payload
            if fmt == 0x04 and attribute == 0x2F:
                return struct.unpack_from("<II", data, at + 4)[1]
            at += 4 + length
    return None


def ptxas_report(compile_kernel):
    """compile_kernel() with nvcc's output recorded (TileLang captures it and keeps it only on failure); returns
    the kernel and ptxas's spill, register-count (with --verbose) and wgmma-serialisation lines."""
    import subprocess
    import types

    from tilelang.contrib import nvcc

    lines = []

    class Recording(subprocess.Popen):
        def communicate(self, *args, **kwargs):
            out, err = super().communicate(*args, **kwargs)
            for stream in (out, err):
                lines.extend(line for line in (stream or b"").decode(errors="replace").splitlines()
                             if "spill" in line or WGMMA_SERIALISED in line or USED_REGISTERS.search(line))
            return out, err

    nvcc.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": Recording})  # for nvcc.py alone
    try:
        return compile_kernel(), lines
    finally:
        nvcc.subprocess = subprocess


# ptxas's message (C7514 and its siblings, "Potential Performance Loss") when it cannot prove that no other
# instruction touches the registers of an asynchronous product in flight: it then waits for every wgmma right
# after issuing it, a slower kernel and no error. Seen when a product stays in flight across a loop's back edge
# while the next iteration waits with wait_group 1 (docs/kernels.md, "Thirty-sixth session").
WGMMA_SERIALISED = "wgmma.mma_async instructions are serialized"
USED_REGISTERS = re.compile(r"Used (\d+) registers")  # ptxas --verbose


def ctas_per_sm(registers: int | None, shared: int, threads: int) -> dict[str, int]:
    """CTAs of a kernel one SM holds, by each limit that applies: registers (allocated per warp in units of 256; none
    when unknown), dynamic shared memory (plus the 1 KiB the driver reserves per CTA; none without any) and warps
    (none when the thread count is unknown, 0)."""
    limits = {}
    if shared:
        limits["shared memory"] = SHARED_PER_SM // (shared + SHARED_RESERVED_PER_CTA)
    if threads:
        warps = max(threads // 32, 1)
        limits["warps"] = MAX_WARPS_PER_SM // warps
        if registers:
            limits["registers"] = REGISTERS_PER_SM // (-(-registers * 32 // 256) * 256 * warps)
    return limits


def occupancy(prim_func, module: str | None = None) -> dict[str, int]:
    """Registers per thread (ptxas), dynamic shared memory (the launch in TileLang's host code), threads and the
    CTAs per SM they allow (`ctas_per_sm`, the least of the limits) of `prim_func` compiled for sm_90a afresh
    (TileLang's cache is off for the call and restored after): what a launch rule that counts CTAs per SM assumes
    (launch.WY_INVERSE_CTAS_PER_SM)."""
    import tilelang
    from tilelang.env import env

    from flashqla.kernels.hopper import launch

    cache_was_on = env.is_cache_enabled()
    tilelang.disable_cache()
    try:
        configs = {**launch._pass_configs(module), "tl.device_compile_flags": ["--ptxas-options=--verbose"]}
        kernel, lines = ptxas_report(lambda: tilelang.compile(prim_func, target=launch.TARGET, pass_configs=configs))
    finally:
        if cache_was_on:
            tilelang.enable_cache()
    used = [int(m.group(1)) for m in map(USED_REGISTERS.search, lines) if m]
    threads = int(re.findall(r"__launch_bounds__\((\d+)", kernel.get_kernel_source())[0])
    shared = launch_shared_memory(kernel.get_host_source(), threads)
    limits = ctas_per_sm(max(used), shared, threads)
    spill_stores = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", "\n".join(lines)))
    return {"registers": max(used), "shared": shared, "threads": threads, "ctas_per_sm": min(limits.values()),
            "spill_stores": spill_stores}


def wgmma_serialisation(prim_func) -> list[str]:
    """ptxas's wgmma-serialisation messages for `prim_func`, compiled for sm_90a afresh (TileLang's cache is
    off for the call: an entry loaded from the cache runs no nvcc; its state is restored after)."""
    import tilelang
    from tilelang.env import env

    from flashqla.kernels.hopper import launch

    cache_was_on = env.is_cache_enabled()
    tilelang.disable_cache()
    try:
        _, lines = ptxas_report(lambda: tilelang.compile(prim_func, target=launch.TARGET,
                                                         pass_configs=launch._pass_configs()))
    finally:
        if cache_was_on:
            tilelang.enable_cache()
    return [line.strip() for line in lines if WGMMA_SERIALISED in line]


def sass_counts(sass: str) -> dict:
    """Static counts of a `cuobjdump -sass` listing: instructions, and some kinds of them by opcode (the part before
    its first dot: MUFU.EX2 counts as MUFU)."""
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
    kinds = {"BRA": "branches", "BSSY": "BSSY", "MUFU": "MUFU", "LDS": "shared loads", "LDL": "spill loads",
             "STL": "spill stores"}
    counts = {"instructions": len(ops)}
    for op, name in kinds.items():
        counts[name] = sum(1 for o in ops if o == op)
    return counts


def write_sass(cubin: str, path: str) -> None:
    tool = shutil.which("cuobjdump")
    if tool is None:
        print("  SASS: no cuobjdump on PATH (see this script's docstring)")
        return
    result = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"  SASS: cuobjdump failed: {result.stderr.strip()}")
        return
    with open(path, "w") as out:
        out.write(result.stdout)
    print("  SASS: " + ", ".join(f"{v} {k}" for k, v in sass_counts(result.stdout).items()) + f" -> {path}")


def main():
    argv = sys.argv[1:]
    source_path = sass_path = None
    while argv[:1] in (["--source"], ["--sass"]):
        if argv[0] == "--source":
            source_path = argv[1]
        else:
            sass_path = argv[1]
        argv = argv[2:]
    if len(argv) < 2:
        sys.exit(__doc__)
    target, builder, *raw = argv
    args = parse_build_args(raw)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TILELANG_CACHE_DIR"] = cache  # a fresh cache: the cubin found below is this kernel's
        import tilelang

        from flashqla.kernels.hopper import launch

        prim_func = load_builder(target, builder)(*args)
        keep = os.path.join(cache, "nvcc")  # nvcc's intermediates, the PTX among them
        os.makedirs(keep)
        configs = {**launch._pass_configs(kernel_module(target, builder)),
                   "tl.device_compile_flags": ["--ptxas-options=--verbose", "--keep", f"--keep-dir={keep}"]}
        kernel, messages = ptxas_report(lambda: tilelang.compile(prim_func, target=launch.TARGET, pass_configs=configs))
        source = kernel.get_kernel_source()
        threads = [int(x) for x in re.findall(r"__launch_bounds__\((\d+)", source)[:1]] or [0]
        ptx = "".join(open(p).read() for p in glob.glob(f"{keep}/*.ptx"))
        if source_path:
            with open(source_path, "w") as out:
                out.write(source)
        host = "".join(open(p).read() for p in glob.glob(f"{cache}/**/host_kernel.cu", recursive=True))
        shared = launch_shared_memory(host, threads[0])
        cubins = glob.glob(f"{cache}/**/*.cubin", recursive=True)
        registers = cubin_registers(cubins[0]) if cubins else None
        if sass_path and cubins:
            write_sass(cubins[0], sass_path)
    layout = re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", source)
    print(f"{target}.{builder}{tuple(args)}: {threads[0]} threads")
    print(f"  registers per thread: {registers if registers is not None else 'n/a (no cubin record)'}")
    print(f"  dynamic shared memory: {shared} bytes ({shared / 1024:.2f} KiB)")
    for line in messages:
        if WGMMA_SERIALISED in line:
            print(f"  ptxas SERIALISES EVERY WGMMA: {line.strip()}")
        elif "spill" in line:
            print(f"  ptxas: {line.strip()}")
    for name, offset in sorted(layout, key=lambda item: int(item[1])):
        print(f"    {int(offset):7d}  {name}")
    known = ctas_per_sm(registers, shared, threads[0])
    print("  CTAs per SM: " + ", ".join(f"{v} by {k}" for k, v in known.items())
          + (f" -> {min(known.values())}" if known else ""))
    # 64-bit integer division lowers to a called routine (SASS CALL): a few for a CTA's indices are normal, one
    # inside a loop's index arithmetic is the trap of docs/kernels.md, "Twenty-ninth session"
    divisions = len(re.findall(r"\b(?:div|rem)\.[su]64\b", ptx))
    print(f"  64-bit integer divisions in the PTX: {divisions}" if ptx else "  PTX: not kept by this nvcc")
    in_loops = barriers_in_unrolled_loops(source)
    print(f"  barriers inside unrolled loops: {len(in_loops)}" + (f" (first at generated line {in_loops[0][0]})"
                                                                   if in_loops else ""))
    for number, line, why in barrier_hazards(source):
        print(f"  HANG RISK: generated line {number}, {why}: {line}")


if __name__ == "__main__":
    main()

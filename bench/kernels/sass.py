"""Compile a Triton kernel for sm_90 on a machine without a GPU and summarise its SASS loops.

Triton's wheel carries ptxas and cuobjdump, so the machine code a kernel gets on the H200 can be read
on any host: registers, spills, and the instruction mix of every loop (the inner loop of a
memory-bound kernel must stay under the issue and integer-pipe budgets; see ``int4_matmul_triton``).

    python bench/kernels/sass.py gemv     # the INT4 kernels at their M = 1 / M = 16 configs
    python bench/kernels/sass.py --dump /tmp/sass gemv   # also writes .sass / .ttgir / .ptx

Arguments marked ``div16`` are specialised as the launcher sees them at run time (pointers and sizes
divisible by 16), so the vector widths match the GPU's build.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench import provenance  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_INSN = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)")
_BRA = re.compile(r"/\*([0-9a-f]{4,})\*/.*\bBRA\b.*?(0x[0-9a-f]+)")


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, div16: set[str], num_warps: int,
                 num_stages: int):
    """signature: Triton type per runtime argument ("*bf16", "i32", ...); constexprs by name."""
    sig = {n: ("constexpr" if n in constexprs else signature[n]) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16 if n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def sass_of(cubin: bytes, scratch: str) -> tuple[str, str]:
    path = os.path.join(scratch, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-sass", path], capture_output=True, text=True,
                          check=True).stdout
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                         text=True, check=True).stdout
    return sass, res


def loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """Each backward branch's body [target, branch] as an opcode histogram, largest first (the main loop
    of these kernels; the others are split-K fix-ups and prologues)."""
    insns = [(int(m.group(1), 16), m.group(3)) for m in map(_INSN.match, sass.splitlines()) if m]
    out = []
    for line in sass.splitlines():
        m = _BRA.search(line)
        if m and int(m.group(2), 16) < int(m.group(1), 16):
            lo, hi = int(m.group(2), 16), int(m.group(1), 16)
            out.append((lo, hi, collections.Counter(op for a, op in insns if lo <= a <= hi)))
    return sorted(out, key=lambda t: t[0] - t[1])


# Opcodes that issue to the integer ALU pipe (half the FP32 rate on Hopper); IMAD issues to the FMA
# pipe. Used to flag loops whose integer work, not memory, sets the pace.
INT_PIPE = {"LOP3", "SHF", "PRMT", "IADD3", "ISETP", "SEL", "LEA", "PLOP3", "VIADD", "IABS", "FLO", "POPC", "BMSK"}


def report(name: str, compiled, scratch: str, weights_per_thread: int | None, dump: str | None,
           tokens: int | None = None) -> dict:
    """Print and return the case's registers, stack and main-loop mix. ``tokens``: rows of x a program
    covers (MMA paths), to put paths with different tiles on one scale: warp instructions per 1024
    weights per 64 tokens, the main loop's issue cost of one 64-token matmul."""
    sass, res = sass_of(compiled.asm["cubin"], scratch)
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    stack = int(re.search(r"STACK:(\d+)", res).group(1))
    row = {"case": name, "registers": regs, "stack_bytes": stack, "shared_bytes": compiled.metadata.shared,
           "num_warps": compiled.metadata.num_warps,
           "l2_prefetches_ptx": compiled.asm["ptx"].count("prefetch.global.L2")}
    print(f"== {name}: {regs} registers, stack {stack} B, shared {row['shared_bytes']} B")
    for lo, hi, ops in loops(sass)[:1]:
        total = sum(ops.values())
        ints = sum(n for op, n in ops.items() if op in INT_PIPE)
        row.update(loop_insns=total, loop_int_pipe=ints, mix=dict(ops.most_common(16)))
        per = ""
        if weights_per_thread:
            row.update(insns_per_weight=round(total / weights_per_thread, 3),
                       int_pipe_per_weight=round(ints / weights_per_thread, 3))
            per = f", {row['insns_per_weight']:.2f} insns and {row['int_pipe_per_weight']:.2f} int-pipe per weight"
        print(f"  loop {lo:#06x}-{hi:#06x}: {total} insns, {ints} int-pipe{per}")
        if weights_per_thread and tokens:
            # a trip: total x warps warp instructions over weights_per_thread x 32 x warps weights
            row["warp_insns_per_1k_weights_64_tokens"] = round(total * 32 / weights_per_thread * 64 / tokens, 1)
            print(f"  {row['warp_insns_per_1k_weights_64_tokens']} warp insns per 1k weights per 64 tokens")
        print("   ", " ".join(f"{op}:{n}" for op, n in ops.most_common(16)))
    if dump:
        os.makedirs(dump, exist_ok=True)
        for key, ext in (("ttgir", "ttgir"), ("ptx", "ptx")):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(compiled.asm[key])
        with open(os.path.join(dump, f"{name}.sass"), "w") as f:
            f.write(sass)
    return row


LOOKAHEAD = False  # --lookahead: the INT4 kernels with their L2 lookahead of the next weight compiled in


def int4_cases():
    """(name, kernel, signature, constexprs, div16, warps, stages, weights per thread per loop trip,
    tokens per program or None)."""
    from kernels import int4_matmul_triton as T

    sig = dict(x_ptr="*bf16", qw_ptr="*i32", scales_ptr="*bf16", zeros_ptr="*bf16", bias_ptr="*bf16",
               res_ptr="*bf16", y_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", K="i32",
               stride_xm="i32", stride_ym="i32", stride_rm="i32", split_k="i32", K_ITERS="i32", one_bits="i32",
               scr_ptr="*i32", pos_ptr="*i32", freq_ptr="*fp32", slot_ptr="*i32", kc_ptr="*bf16", vc_ptr="*bf16",
               la_q_ptr="*i32", la_q_lines="i32", la_s_ptr="*bf16", la_s_lines="i32")
    div16 = {"x_ptr", "qw_ptr", "scales_ptr", "zeros_ptr", "bias_ptr", "res_ptr", "y_ptr", "part_ptr",
             "count_ptr", "scr_ptr", "N", "K", "stride_xm", "stride_ym", "stride_rm"}
    base = dict(G=128, HAS_ZEROS=True, HAS_BIAS=False, HAS_RES=False, SILU=False, USE_SPLIT=True,
                ROPE=False, R_H=1, R_HKV=1, R_HALF=64, R_PAGE=16,  # no RoPE epilogue (its pointers go unused)
                LOOKAHEAD=LOOKAHEAD)
    cases = []
    for cfg in T.sass_configs():
        const = dict(base, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        kernel, extra = T.kernel_for(cfg, True, base["G"], True, pdl=True, whole_zeros=True)
        const.update(extra)
        const = {n: v for n, v in const.items() if n in kernel.arg_names}
        threads = 32 * cfg.num_warps
        cases.append((f"{cfg.kind}_m{cfg.block_m}_n{cfg.block_n}_k{cfg.block_k}_w{cfg.num_warps}", kernel,
                      sig, const, div16, cfg.num_warps, cfg.num_stages, cfg.block_n * cfg.block_k // threads,
                      cfg.block_m if cfg.kind.startswith("mma") else None))
    return cases


def decode_cases():
    """The paged decode kernel's pipelined loop at its default config, and its hand-prefetched loop at the
    tiles ``bench/kernels/prefetch_probe.py`` sweeps (bf16, 32 query / 8 KV heads, D = 128)."""
    from bench.kernels import prefetch_probe as RP
    from kernels import paged_decode as PD

    sig = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", bt_ptr="*i32", seq_lens_ptr="*i32", o_ptr="*fp32",
               lse_ptr="*fp32", qk_scale="fp32", stride_qb="i32", stride_qh="i32", stride_kb="i32",
               stride_kp="i32", stride_kh="i32", stride_btb="i32", stride_os="i32", stride_ob="i32",
               stride_oh="i32", stride_ls="i32", stride_lb="i32", num_splits="i32")
    div16 = {"q_ptr", "k_ptr", "v_ptr", "bt_ptr", "seq_lens_ptr", "o_ptr", "lse_ptr", "stride_qb", "stride_qh",
             "stride_kb", "stride_kp", "stride_kh", "stride_os", "stride_ob", "stride_oh", "stride_ls", "stride_lb"}
    base = dict(GROUP=4, PAGE=16, HEAD_DIM=128, BLOCK_G=16, IS_SPLIT=True)
    base = dict(base, LEN_OFFSET=0, USE_PDL=True, BT_CHUNK=0)
    cases = [("decode_pipelined_n64_st3_w4", PD._paged_decode_kernel, sig, dict(base, BLOCK_N=64, PREFETCH=False),
              div16, 4, 3, None, None)]
    for bt in (16, 64):
        for st in (3, 4):
            cases.append((f"decode_chunked{bt}_n64_st{st}_w4", PD._paged_decode_kernel, sig,
                          dict(base, BLOCK_N=64, PREFETCH=False, BT_CHUNK=bt), div16, 4, st, None, None))
    for bn, nw in RP.RP_TILES:
        cases.append((f"decode_prefetch_n{bn}_w{nw}", PD._paged_decode_kernel, sig,
                      dict(base, BLOCK_N=bn, PREFETCH=True), div16, nw, 1, None, None))
    return cases


CASES = {"int4": int4_cases, "decode": decode_cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=sorted(CASES))
    ap.add_argument("--dump", help="folder for .sass / .ttgir / .ptx of each case")
    ap.add_argument("--out", help="write the rows as JSON here (with date, commit, Triton version)")
    ap.add_argument("--factored", action="store_true",
                    help="int4: the MMA paths' factored zero point (a dot against ones), as for fractional zeros")
    ap.add_argument("--only", nargs="+", metavar="PREFIX", help="only the cases whose names start so")
    ap.add_argument("--lookahead", action="store_true",
                    help="int4: with the L2 lookahead of the next weight (SPECGATE_INT4_LOOKAHEAD) compiled in")
    args = ap.parse_args()
    global LOOKAHEAD
    LOOKAHEAD = args.lookahead
    if args.factored:
        from kernels import int4_matmul_triton as T
        T.ZDEC = False
    scratch = args.dump or os.environ.get("TMPDIR", "/tmp")
    os.makedirs(scratch, exist_ok=True)
    rows = [report(name, compile_sm90(fn, sig, const, div16, warps, stages), scratch, wpt, args.dump, tokens)
            for name, fn, sig, const, div16, warps, stages, wpt, tokens in CASES[args.which]()
            if not args.only or name.startswith(tuple(args.only))]
    if args.out:
        doc = {"target": "sm_90 (compiled on the host: ptxas and cuobjdump from Triton's wheel)",
               "triton": triton.__version__, "date": datetime.date.today().isoformat(),
               "commit": provenance.commit(), "which": args.which,
               "zero_points": "factored (sum_k x against ones)" if args.factored else "whole, subtracted in 16 bits",
               "lookahead": args.lookahead,
               "rows": rows}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()

import os
base = open("/work/main/generated/flash_attention/triton_decode.py").read()
OLD_START = """        start = 0
        end = tl.minimum(tl.maximum(tl.load(ENDS + off_b), 0), MAX_PAGES * PAGE)"""
assert OLD_START in base
V = {}
# A: start a runtime value the compiler cannot see is 0: the host passes the raw lengths as STARTS and ENDS
V["A_load_diff"] = base.replace(OLD_START, """        raw = tl.load(ENDS + off_b)
        start = tl.load(STARTS + off_b) - raw  # 0 (the host passes the lengths as both): opaque to LLVM
        end = tl.minimum(tl.maximum(raw, 0), MAX_PAGES * PAGE)""")
# B: an opaque 0 from inline PTX (no memory access)
V["B_asm_zero"] = base.replace(OLD_START, """        start = tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [off_b], dtype=tl.int32, is_pure=True, pack=1)
        end = tl.minimum(tl.maximum(tl.load(ENDS + off_b), 0), MAX_PAGES * PAGE)""")
# E: start 0 but end unclamped (is the clamp's bound what lets LLVM widen?)
V["E_noendclamp"] = base.replace(OLD_START, """        start = 0
        end = tl.load(ENDS + off_b)""")
for k, v in V.items():
    open(f"variants/{k}.py", "w").write(v)
# C: B's opaque start, and the page arithmetic by shift / mask where PAGE is a power of two (t >= 0 always)
OLD_ROWS = """            pg = tl.minimum(tl.maximum(tl.load(TABLE + off_b * MAX_PAGES + t // PAGE, mask=col_ok, other=0), 0),
                            POOL_PAGES - 1)
            rows = pg.to(tl.int64) * PAGE + t % PAGE"""
assert OLD_ROWS in base
NEW_ROWS = """            if PAGE & (PAGE - 1) == 0:  # t >= 0: its page and row by shift and mask (t // PAGE would be signed)
                t_page = t >> (PAGE.bit_length() - 1)
                t_row = t & (PAGE - 1)
            else:
                t_page = t // PAGE
                t_row = t % PAGE
            pg = tl.minimum(tl.maximum(tl.load(TABLE + off_b * MAX_PAGES + t_page, mask=col_ok, other=0), 0),
                            POOL_PAGES - 1)
            rows = pg.to(tl.int64) * PAGE + t_row"""
V2 = {}
V2["C_asm_zero_shift"] = V["B_asm_zero"].replace(OLD_ROWS, NEW_ROWS)
V2["C2_load_diff_shift"] = V["A_load_diff"].replace(OLD_ROWS, NEW_ROWS)
V2["S_cur_shift"] = base.replace(OLD_ROWS, NEW_ROWS)  # current + shifts only (control)
for k, v in V2.items():
    open(f"variants/{k}.py", "w").write(v)
# F: start stays the constant 0 (kv_idx = t, no sdiv fixups); only the loop's first key gets an opaque 0 added, so
# LLVM cannot bound the induction variable (no i64 widening), and Triton is told it is a multiple of BLOCK_N
OLD_LO = "    lo = start + split * SPLIT\n"
assert OLD_LO in base
NEW_LO = """    lo = start + split * SPLIT
    if PAGED:  # + an opaque 0: LLVM would otherwise bound the loop's keys and widen them to 64 bits (20 registers)
        lo = tl.multiple_of(lo + tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [off_b], dtype=tl.int32,
                                                           is_pure=True, pack=1), BLOCK_N)
"""
V3 = {}
V3["F_opaque_lo_shift"] = base.replace(OLD_LO, NEW_LO).replace(OLD_ROWS, NEW_ROWS)
V3["F2_opaque_lo_div"] = base.replace(OLD_LO, NEW_LO)
for k, v in V3.items():
    open(f"variants/{k}.py", "w").write(v)
# G: F with the opaque 0 masked to a multiple of BLOCK_N (LLVM then knows the keys' low bits: t & (PAGE-1) and
# t >> log2(PAGE) shared per lane as before), its sign still unknown (no bound, no widening)
NEW_LO_G = """    lo = start + split * SPLIT
    if PAGED:  # + an opaque 0 (a multiple of BLOCK_N of unknown sign): else LLVM bounds the loop's keys and widens
        # them to 64 bits (sm_90, Triton 3.6: 96 -> 116 registers, 5 -> 4 programs an SM)
        zero = tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [off_b], dtype=tl.int32, is_pure=True, pack=1)
        lo = tl.multiple_of(lo + (zero & -BLOCK_N), BLOCK_N)
"""
V4 = {"G_opaque_lo_aligned_shift": base.replace(OLD_LO, NEW_LO_G).replace(OLD_ROWS, NEW_ROWS),
      "G2_opaque_lo_aligned_div": base.replace(OLD_LO, NEW_LO_G)}
for k, v in V4.items():
    open(f"variants/{k}.py", "w").write(v)

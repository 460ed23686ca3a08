base = open("/work/main/abtree-fix/generated/flash_attention/triton_decode.py").read()
ASM = """tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [off_b], dtype=tl.int32,
                                                           is_pure=True, pack=1)"""
assert ASM in base
V = {"H_starts_minus_ends": "(tl.load(STARTS + off_b) - tl.load(ENDS + off_b))",
     "H_volatile_reread": "(tl.load(ENDS + off_b, volatile=True) - tl.load(ENDS + off_b))"}
for k, v in V.items():
    open(f"variants/{k}.py", "w").write(base.replace(ASM, v))

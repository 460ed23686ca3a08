"""Loop stats from an sm_90 cubin: nvdisasm -c, find backward BRAs, count instructions by opcode in [target, bra]."""
import re, subprocess, sys, collections, os
NV = "/work/triton36/triton/backends/nvidia/bin/nvdisasm"
def sass(cubin):
    out = subprocess.run([NV, "-c", cubin], capture_output=True, text=True).stdout
    ins = []
    for l in out.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", l)
        if m: ins.append((int(m.group(1), 16), m.group(2).strip()))
    labels = {}
    for l in out.splitlines():
        m = re.match(r"^(\.L_x_\d+):", l)
        if m: labels[m.group(1)] = None
    # map labels to addresses: label line precedes next instruction
    cur = []
    lab_addr = {}
    for l in out.splitlines():
        m = re.match(r"^(\.L_x_\d+):", l)
        if m: cur.append(m.group(1)); continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", l)
        if m:
            for c in cur: lab_addr[c] = int(m.group(1), 16)
            cur = []
    return ins, lab_addr, out
def op(i):
    s = re.sub(r"^@!?U?P\w+\s+", "", i)
    return s.split()[0]
if __name__ == "__main__":
    for f in sys.argv[1:]:
        ins, lab, text = sass(f)
        n = len([i for i in ins if op(i[1]) != "NOP"])
        print(f"== {os.path.basename(f)}: {n} instructions (no NOP)")
        for a, i in ins:
            m = re.search(r"BRA\s+.*?(\.L_x_\d+)", i)
            if m and lab.get(m.group(1), 1 << 30) < a:
                body = [x for x in ins if lab[m.group(1)] <= x[0] <= a and op(x[1]) != "NOP"]
                c = collections.Counter(op(x[1]).split(".")[0] for x in body)
                print(f"  loop {lab[m.group(1)]:#x}..{a:#x}: {len(body)} instr;", dict(sorted(c.items(), key=lambda kv: -kv[1])))

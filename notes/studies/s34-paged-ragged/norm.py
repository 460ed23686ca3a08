import re, sys
txt = open(sys.argv[1]).read()
txt = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", txt)
names = {}
def sub(m):
    n = m.group(0)
    if n not in names: names[n] = f"%v{len(names)}"
    return names[n]
lines = txt.splitlines()
a = next(i for i, l in enumerate(lines) if "scf.for" in l)
b = next(i for i, l in enumerate(lines) if i > a and "scf.yield" in l)
for l in lines[a:b + 1]:
    print(re.sub(r"%[A-Za-z_][\w]*|%\d+", sub, l).strip())

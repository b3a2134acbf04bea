"""Check exercise_questions.py: the solution passes, the stubs and honest wrong answers fail (python handoff/check_exercise.py)."""
import json, re, sys, torch
from course_lib.tools.grading.checks import raised, same, close

def cells(path):
    out, cur = [], None
    for line in open(path).read().splitlines():
        m = re.match(r"^# %%( \[markdown\])?(.*)$", line)
        if m:
            meta = {}
            for k, v in re.findall(r'(\w+)=(\{.*?\})(?= \w+=|$)', m.group(2).strip()):
                meta[k] = json.loads(v)
            cur = {"type": "markdown" if m.group(1) else "code", "meta": meta, "src": []}
            out.append(cur)
        else:
            cur["src"].append(line)
    for c in out:
        c["src"] = "\n".join(c["src"]).strip("\n")
    return out

def strip_hidden(src):
    return re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\n?", "", src, flags=re.S)

def run(mutate=None, hidden=True):
    cs = cells("handoff/exercise_questions.py")
    ns = {"torch": torch, "raised": raised, "same": same, "close": close}
    results = {}
    for c in cs:
        if c["type"] != "code": continue
        src = c["src"]
        nb = c["meta"].get("nbgrader", {})
        if nb.get("solution"):
            if mutate and mutate[0] == nb["grade_id"]:
                src = mutate[1](src)
            exec(src, ns)
        elif nb.get("grade"):
            try:
                exec(src if hidden else strip_hidden(src), ns); results[nb["grade_id"]] = "pass"
            except Exception as e:
                results[nb["grade_id"]] = f"FAIL {type(e).__name__}: {str(e)[:100]}"
    return results

def stub(src):
    return re.sub(r"### BEGIN SOLUTION.*?### END SOLUTION", "raise NotImplementedError('write it')", src, flags=re.S)

print("solution   ", run())
print("solution visible only", run(hidden=False))
Q3, Q4 = "q3_dispatch_indices", "q4_exchange_splits"
muts = {
 "stub q3": (Q3, stub), "stub q4": (Q4, stub),
 "token-major": (Q3, lambda s: s.replace("expert.t().reshape(-1)\n", "expert.reshape(-1)\n")),
 "<= capacity": (Q3, lambda s: s.replace("position < capacity", "position <= capacity")),
 "unstable sort": (Q3, lambda s: s.replace("torch.argsort(flat, stable=True)", "torch.argsort(flat)")),
 "1-based position": (Q3, lambda s: s.replace("- starts[flat[order]]", "- starts[flat[order]] + 1")),
 "no id check": (Q3, lambda s: s.replace("raise ValueError(f\"expert ids", "pass  # (f\"expert ids")),
 "recv = send": (Q4, lambda s: s.replace("recv = [[send[r][q] for r in range(ep)] for q in range(ep)]", "recv = [row[:] for row in send]")),
 "interleaved experts": (Q4, lambda s: s.replace("sum(row[q * per:(q + 1) * per])", "sum(row[q::ep])")),
}
for name, m in muts.items():
    print(f"{name:20s}", run(m), "| visible:", run(m, hidden=False)[m[0] + "_test"])

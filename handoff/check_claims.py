"""Run the section's claim tests on a results file: python handoff/check_claims.py results.jsonl (no notebook needed)."""
import sys, importlib.util, inspect
from course_lib.tools.report import load
c = load(sys.argv[1])
spec = importlib.util.spec_from_file_location("claims", "handoff/test_moe_claims.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
bad = 0
for name, fn in inspect.getmembers(m, inspect.isfunction):
    if name.startswith("test_"):
        try: fn(c); print("ok  ", name)
        except Exception as e: bad += 1; print("FAIL", name, repr(e)[:500])
sys.exit(bad)

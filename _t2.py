import json, sys
from benchmarks.model import SIZES
from benchmarks.step_overhead import run_step_overhead
from benchmarks.variants import ALL_VARIANTS
if __name__ == "__main__":
    s = run_step_overhead(SIZES[sys.argv[1]], rounds=int(sys.argv[2]), warmup=1, steps_per_round=int(sys.argv[3]), keys=ALL_VARIANTS)
    print(json.dumps(s, indent=1))

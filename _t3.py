import json
from benchmarks.model import SIZES
from benchmarks.export_throughput import run_export_throughput
if __name__ == "__main__":
    print(json.dumps(run_export_throughput(SIZES["medium"], file_steps=100, min_seconds=0.5, repeats=2), indent=1))

import sys, gc, tracemalloc, tempfile
from benchmarks.common import quiet, rss_mb
quiet()
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from benchmarks.model import build_model, make_batch, train_step, SIZES
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
cfg = SIZES["small"]
model = build_model(cfg, init_device_mesh("cpu", (4,))); batch = make_batch(cfg)
from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter
d = tempfile.mkdtemp()
ex = [JsonlSpanExporter(d + "/x-rank{rank}.jsonl")] if "jsonl" in sys.argv else []
mode = CommSpanMode(exporters=ex, aggregator="noagg" not in sys.argv)
N = int(sys.argv[1])
with mode:
    for i in range(20):
        with mode.step(i): train_step(model, batch)
    b = rss_mb(); n0 = len(gc.get_objects())
    tracemalloc.start(8)
    s0 = tracemalloc.take_snapshot()
    for i in range(20, 20 + N):
        with mode.step(i): train_step(model, batch)
    gc.collect()
    s1 = tracemalloc.take_snapshot()
    print(sys.argv[1:], "RSS growth KB/step", (rss_mb()-b)*1024/N, "objs/step", (len(gc.get_objects())-n0)/N)
    for st in s1.compare_to(s0, "traceback")[:3]:
        print(st.size_diff/N, "B/step", st.count_diff/N, "objs/step")
        for l in st.traceback.format()[-8:]: print("   ", l)

import sys, gc, dataclasses
from benchmarks.common import quiet, rss_mb
quiet()
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from benchmarks.model import build_model, make_batch, train_step, SIZES
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
cfg = dataclasses.replace(SIZES["small"], checkpoint_every=int(sys.argv[1]))
model = build_model(cfg, init_device_mesh("cpu", (4,))); batch = make_batch(cfg)
from commspan import CommSpanMode
import commspan.module_tracker as MT, commspan.spans as SP
if "patch" in sys.argv:
    _orig = SP.SpanRecorder.close_now
    SP.SpanRecorder.close_now = lambda self, frame, error=None: _orig(self, frame, None)
    MT.ModuleTracker._record_exception = lambda self, f, e: None
mode = CommSpanMode(aggregator=sys.argv[2] == "agg")
with mode:
    for i in range(10):
        with mode.step(i): train_step(model, batch)
    b = rss_mb()
    for i in range(10, 40):
        with mode.step(i): train_step(model, batch)
    print(sys.argv[1:], "growth MB/step", (rss_mb()-b)/30)
    ts = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    print("live tensors", len(ts))
    from commspan.spans import Frame
    fr = [o for o in gc.get_objects() if isinstance(o, Frame)]
    print("live Frames", len(fr))
    if fr:
        f = fr[len(fr)//2]
        for r in gc.get_referrers(f)[:5]: print("  ref:", type(r), str(r)[:150])
    excs = [o for o in gc.get_objects() if isinstance(o, BaseException)]
    print("live exceptions", len(excs), set(type(e).__name__ for e in excs))
    from commspan.module_tracker import _Call
    calls = [o for o in gc.get_objects() if isinstance(o, _Call)]
    print("live _Call", len(calls))
    errs = [f for f in fr if f.error is not None]
    print("Frames with error", len(errs))

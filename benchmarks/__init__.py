"""commspan's benchmarks: ``python -m benchmarks`` (see docs/performance.md).

Sections, each runnable alone with ``--only``:

* ``step`` (:mod:`benchmarks.step_overhead`): step-time overhead of tracing on
  4 ranks over gloo, variants interleaved round by round;
* ``export`` (:mod:`benchmarks.export_throughput`): JSONL spans/s and
  ``Aggregator.from_jsonl`` events/s;
* ``memory`` (:mod:`benchmarks.memory`): RSS over many traced steps;
* ``profile`` (:mod:`benchmarks.hotspots`): where commspan's time goes.
"""

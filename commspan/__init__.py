"""commspan: PyTorch collectives attributed to modules, as OpenTelemetry spans.

The public names load lazily, so importing ``commspan`` (the pytest plugin
does, in every test session) does not import torch until one is used.

Example:
    >>> import torch
    >>> from commspan import CommSpanMode
    >>> mode = CommSpanMode()
    >>> with mode:
    ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
    >>> mode.aggregator.module_counts()
    {}
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

__version__ = "0.1.0"

__all__ = [
    "Aggregator",
    "CollectiveSummary",
    "CommSpanMode",
    "Phase",
    "RankSample",
    "StepPlan",
    "__version__",
    "plan_step",
]

_LAZY = {
    "Aggregator": ".analysis.counts",
    "CollectiveSummary": ".analysis.counts",
    "CommSpanMode": ".session.mode",
    "Phase": ".semconv",
    "RankSample": ".session.sampling",
    "StepPlan": ".session.plan",
    "plan_step": ".session.plan",
}

if _typing.TYPE_CHECKING:
    from commspan.analysis.counts import Aggregator, CollectiveSummary
    from commspan.semconv import Phase
    from commspan.session.mode import CommSpanMode
    from commspan.session.plan import StepPlan, plan_step
    from commspan.session.sampling import RankSample


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'commspan' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""commspan: PyTorch collectives attributed to modules, as OpenTelemetry spans.

Example:
    >>> import torch
    >>> from commspan import CommSpanMode
    >>> mode = CommSpanMode()
    >>> with mode:
    ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
    >>> mode.aggregator.module_counts()
    {}
"""

from commspan.aggregate import Aggregator, CollectiveSummary
from commspan.semconv import Phase
from commspan.session import CommSpanMode

__version__ = "0.1.0"

__all__ = [
    "Aggregator",
    "CollectiveSummary",
    "CommSpanMode",
    "Phase",
    "__version__",
]

"""Drop-in stand-ins for torch's ``CommDebugMode`` and ``ModTracker``, on commspan.

Tests and tools written against the torch classes run on commspan by
changing one import::

    # from torch.distributed.tensor.debug import CommDebugMode
    from commspan.compat import CommDebugMode

:class:`CommDebugMode` keeps what torch 2.13's keeps (counts per op and per
module and phase, the ops run in each module, the module tracker's
dictionaries) and writes the same reports: the tracing table at noise levels
0-3, its log file and the JSON file torch's browser visualizer reads. Counts
are keyed the way torch keys them (``torch.ops.c10d_functional`` packets for
functional collectives, ``torch.ops.c10d`` packets for c10d ops), and lookups
also accept native packets, overloads and canonical names (``"all_reduce"``).
Unlike torch 2.13's classes, these survive one module running twice in a
context and leave no hook behind. docs/compat.md lists what differs and which
of PyTorch's own tests pass on them.

Example:
    >>> import torch
    >>> from commspan.compat import ModTracker
    >>> layer = torch.nn.Linear(2, 2)
    >>> with ModTracker() as tracker:
    ...     _ = layer(torch.ones(1, 2))
    >>> tracker.get_known_fqn(layer)
    'Linear'
"""

from commspan.compat.comm_debug_mode import CommDebugMode
from commspan.compat.mod_tracker import HookAlreadyRegisteredError, ModTracker

__all__ = ["CommDebugMode", "HookAlreadyRegisteredError", "ModTracker"]

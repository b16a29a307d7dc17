"""Process groups and device meshes, as collectives' events name them.

:class:`ProcessGroups` resolves a process group (an object, a boxed
``ScriptObject``, a group name, or the ranks list of legacy functional
collectives) to ``(name, size, global ranks)`` once, numbers each group's
collectives (``commspan.collective.seq``) and its point-to-point ops per peer
and direction (``commspan.p2p.seq``), and remembers which mesh dimension
each group of a known device mesh is (``commspan.mesh.dim``) and its name
(``commspan.mesh.dim_name``). A group that is a dimension of several meshes
(``mesh["tp"]`` and the 2-D mesh it was sliced from) is described by the mesh
with the most dimensions.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ProcessGroups", "group_key"]

_log = logging.getLogger(__name__)
_MESH_DESC = "mesh_"
# what DeviceMesh calls the groups of a mesh whose dimensions have no names
_UNNAMED = re.compile(r"mesh_(dim_\d+|default)?")


def group_key(group: Any) -> str | None:
    """The name of a process group object, its cache key.

    Not ``id(group)``: a c10d op receives a freshly boxed process group on every
    call, and once that box is freed its id is soon another group's box.
    """
    try:
        if isinstance(group, torch.ScriptObject):
            import torch.distributed as dist

            group = dist.ProcessGroup.unbox(group)
        return str(group.group_name)
    except Exception:
        return None


class ProcessGroups:
    """Process group -> ``(name, size, global ranks)``, resolved once; mesh dimensions.

    One registry per mode, handed to both the module hooks (which learn the
    device meshes of DTensor parameters) and the dispatch mode (which learns
    the meshes of redistributions and describes each collective's group); so
    neither calls into the other.
    """

    def __init__(self) -> None:
        self._by_key: dict[Any, tuple[str, int, list[int]] | None] = {}
        self._seq: dict[Any, int] = {}
        self.mesh_dims: dict[str, int] = {}
        self.mesh_dim_names: dict[str, str] = {}
        self._mesh_ndim: dict[str, int] = {}  # ndim of the mesh that described each group
        # id -> weak reference: an id alone would be another mesh's once this one dies
        self._meshes: dict[int, Callable[[], Any]] = {}

    def add_mesh(self, mesh: Any) -> None:
        """Learn which mesh dimension each of ``mesh``'s process groups is."""
        key = id(mesh)
        known = self._meshes.get(key)
        if known is not None and known() is mesh:
            return
        try:
            self._meshes[key] = weakref.ref(mesh)
        except TypeError:  # not weakly referenceable: keep it
            self._meshes[key] = lambda: mesh
        try:
            ndim = int(mesh.ndim)
            names = getattr(mesh, "mesh_dim_names", None) or ()
            for dim in range(ndim):
                group = str(mesh.get_group(dim).group_name)
                if self._mesh_ndim.get(group, 0) > ndim:
                    continue  # a larger mesh already described it
                self._mesh_ndim[group] = ndim
                self.mesh_dims[group] = dim
                if dim < len(names) and names[dim]:
                    self.mesh_dim_names[group] = str(names[dim])
        except Exception as exc:
            _log.debug("commspan: cannot read the groups of mesh %r: %s", mesh, exc)

    def next_seq(self, name: str) -> int:
        """The next collective's sequence number on group ``name``."""
        n = self._seq.get(name, 0) + 1
        self._seq[name] = n
        return n

    def next_p2p_seq(self, name: str, op: str, peer: Any) -> int:
        """The next number of point-to-point op ``op`` (``send``, ``recv``) with ``peer``
        on group ``name``: the k-th send to a peer matches the k-th receive there from
        this rank (both backends match point-to-point ops in order per pair)."""
        key = (name, op, peer)
        n = self._seq.get(key, 0) + 1
        self._seq[key] = n
        return n

    def get(self, group: Any) -> tuple[str, int, list[int]] | None:
        if group is None:
            return None
        key = group if isinstance(group, (str, tuple, int)) else group_key(group)
        if key is None:
            return self._resolve(group)
        try:
            return self._by_key[key]
        except KeyError:
            pass
        value = self._resolve(group)
        self._by_key[key] = value
        return value

    def _resolve(self, group: Any) -> tuple[str, int, list[int]] | None:
        try:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d as c10d

            pg: Any
            if isinstance(group, tuple):  # legacy funcol: ranks list
                ranks = list(group)
                try:
                    name = str(c10d._resolve_group_name_by_ranks_and_tag(ranks, ""))
                except Exception:
                    name = "ranks:" + ",".join(map(str, ranks))
                return name, len(ranks), ranks
            if isinstance(group, str):
                pg = c10d._resolve_process_group(group)  # type: ignore[arg-type]
            elif isinstance(group, torch.ScriptObject):
                pg = dist.ProcessGroup.unbox(group)
            else:
                pg = group
            name = str(pg.group_name)
            ranks = list(dist.get_process_group_ranks(pg))
            desc = getattr(pg, "group_desc", None)
            if isinstance(desc, str) and desc.startswith(_MESH_DESC) \
                    and not _UNNAMED.fullmatch(desc) and name not in self.mesh_dim_names:
                # a device mesh's dimension (DeviceMesh describes its groups as
                # "mesh_<dim name>"), met before any DTensor of that mesh told commspan
                # of it (distribute_tensor's scatter, a redistribution)
                self.mesh_dim_names[name] = desc[len(_MESH_DESC):]
            return name, int(pg.size()), ranks
        except Exception as exc:
            _log.debug("commspan: cannot resolve process group %r: %s", group, exc)
            if isinstance(group, str):
                return group, 0, []
            return None

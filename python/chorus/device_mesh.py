"""A ``torch.distributed`` ``DeviceMesh`` over Chorus communicators
(TorchComms' ``torchcomms.device_mesh``).

::

    import chorus
    from chorus.device_mesh import init_device_mesh

    world = chorus.new_comm("cpu", "cpu", "world")
    r = world.get_rank()
    tp = world.split([r // 2 * 2, r // 2 * 2 + 1], f"tp{r // 2}")  # neighbours
    dp = world.split([r % 2, r % 2 + 2], f"dp{r % 2}")              # strided
    mesh = init_device_mesh((dp, tp), ("dp", "tp"), _global_comm=world)
    torch.distributed.all_reduce(x, group=mesh.get_group("tp"))

Each communicator becomes a registered process group (a c10d
``ProcessGroup`` with a :class:`chorus.torch.ChorusBackend` on the CPU), named
after its mesh dimension, so torch's parallelism APIs (``DTensor``, FSDP,
tensor parallel) run their collectives on Chorus. The mesh is row-major over
the dimensions given: the global rank of the rank at local ranks
``(i0, i1, ...)`` is ``i0 * size1 * ... + i1 * ... + ...``, so the
communicators must have been split that way (as above). Without
``torch.distributed.init_process_group``, the global communicator's group
becomes the default group. Needs torch. O(world size) memory for the mesh.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from .torch import BACKEND, ChorusBackend

__all__ = ["init_device_mesh"]


def _register(comm, group_name, global_ranks, backend_str=BACKEND):
    """A process group over ``comm`` registered with torch under
    ``group_name``; ``global_ranks``: the global rank of each of its ranks."""
    pg = dist.ProcessGroup(dist.HashStore(), comm.get_rank(), comm.get_size())
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, ChorusBackend(comm))
    pg._set_group_name(group_name)
    world = _c10d._world
    # No store of torch's is involved: an empty one satisfies the
    # interfaces that clone the group's store.
    world.pg_map[pg] = (backend_str, dist.HashStore())
    world.pg_names[pg] = group_name
    world.pg_backend_config[pg] = str(dist.BackendConfig(dist.Backend(BACKEND)))
    world.pg_group_ranks[pg] = {g: i for i, g in enumerate(global_ranks)}
    tag = f"ptd:{group_name}"
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.pg_to_tag[pg] = tag
    _c10d._register_process_group(group_name, pg)
    return pg


def _create_torchcomm_process_group(comm, group_name, backend_str=BACKEND, global_ranks_mapping=None):
    """TorchComms' helper of the same name: a process group over ``comm``
    registered with torch as ``group_name``. ``global_ranks_mapping``: global
    rank -> rank in ``comm`` (default: the identity, for a group of every
    rank)."""
    if global_ranks_mapping is None:
        global_ranks = list(range(comm.get_size()))
    else:
        global_ranks = [g for g, _ in sorted(global_ranks_mapping.items(), key=lambda kv: kv[1])]
        if len(global_ranks) != comm.get_size():
            raise ValueError(
                f"global_ranks_mapping names {len(global_ranks)} ranks, the communicator has "
                f"{comm.get_size()}"
            )
    return _register(comm, group_name, global_ranks, backend_str)


def _flatten_with_comm(mesh, mesh_dim_name, comm, global_ranks, layout):
    """TorchComms' helper of the same name: register ``comm`` (holding
    ``global_ranks``) as the flattened dimension ``mesh_dim_name`` of
    ``mesh``, with the mesh ``layout`` of the dimensions it flattens, and
    return the flattened ``DeviceMesh``."""
    _create_torchcomm_process_group(
        comm, mesh_dim_name, global_ranks_mapping={g: i for i, g in enumerate(global_ranks)}
    )
    if hasattr(layout, "coalesce"):
        coalesced = layout.coalesce()
    else:  # torch 2.13+: _MeshLayout.collapse()
        from torch.distributed._mesh_layout import _MeshLayout

        coalesced = _MeshLayout([layout.collapse()])
    if hasattr(mesh, "_rank_map"):
        flat = dist.DeviceMesh(
            device_type="cpu",
            mesh_dim_names=(mesh_dim_name,),
            _init_backend=False,
            _rank=comm.get_rank(),
            _layout=coalesced,
            _rank_map=mesh._rank_map,
            _root_mesh=mesh,
        )
    else:
        flat = dist.DeviceMesh(
            device_type="cpu",
            mesh=torch.tensor(global_ranks, device="cpu"),
            mesh_dim_names=(mesh_dim_name,),
            _init_backend=False,
            _rank=comm.get_rank(),
            _layout=coalesced,
        )
    flat._dim_group_names = [mesh_dim_name]
    flat._root_mesh = mesh._get_root_mesh()
    flat._root_mesh._flatten_mapping[mesh_dim_name] = flat
    return flat


def init_device_mesh(mesh_dim_comms, mesh_dim_names, _global_comm=None):
    """A ``DeviceMesh`` whose dimension ``i`` runs on ``mesh_dim_comms[i]``
    (a :class:`chorus.Comm`), named ``mesh_dim_names[i]``. ``_global_comm``
    (required with two or more dimensions): the communicator of every rank,
    registered under its own name and made the default group."""
    comms, names = tuple(mesh_dim_comms), tuple(mesh_dim_names)
    if not comms or len(comms) != len(names):
        raise ValueError("init_device_mesh needs one name per communicator, and at least one")
    if len(comms) > 1 and _global_comm is None:
        raise ValueError("a mesh of two or more communicators needs _global_comm")
    shape = tuple(c.get_size() for c in comms)
    world_size = math.prod(shape)
    if _global_comm is not None and _global_comm.get_size() != world_size:
        raise ValueError(
            f"the mesh {shape} holds {world_size} ranks, the global communicator "
            f"{_global_comm.get_size()}"
        )
    mesh = torch.arange(world_size, dtype=torch.int).view(shape)
    coords = tuple(c.get_rank() for c in comms)
    me = int(mesh[coords].item())
    if _global_comm is not None and _global_comm.get_rank() != me:
        raise ValueError(
            f"rank {_global_comm.get_rank()} of the global communicator sits at {coords} "
            f"in the mesh, which is global rank {me}: split the communicators row-major"
        )
    default = None
    if _global_comm is not None:
        default = _register(_global_comm, _global_comm.get_name(), list(range(world_size)))
    for dim, (comm, name) in enumerate(zip(comms, names)):
        # This rank's line of the mesh along `dim`: the global ranks of its group.
        index = list(coords)
        index[dim] = slice(None)
        line = [int(g) for g in mesh[tuple(index)].reshape(-1).tolist()]
        pg = _register(comm, name, line)
        if default is None:
            default = pg
    if _c10d.GroupMember.WORLD is None:
        _c10d.GroupMember.WORLD = default
    device_mesh = dist.DeviceMesh(
        device_type="cpu", mesh=mesh, mesh_dim_names=names, _init_backend=False, _rank=me
    )
    device_mesh._dim_group_names = list(names)
    return device_mesh

"""What the families' mesh wrappers and sequence-parallel forms share (docs/DESIGN.md §4, Transformations): reading
PartitionSpecs (each dim's mesh axes), showing and comparing them, and the mesh axis a call runs over (bound inside
``jax.shard_map``, or the mesh a ``with`` block put in scope)."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P


def entry(axes: tuple):
    """A PartitionSpec entry for a tuple of mesh axes: None, one name, or the tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def axes_of(entry) -> tuple:
    """The mesh axes of a PartitionSpec entry; TypeError where it is not an axis name, a tuple of them or None."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
        return entry
    raise TypeError(entry)


def check_mesh(name: str, mesh, in_specs, given: str, example: str) -> None:
    """The mesh wrapper's first checks, one message each naming the argument: ``mesh`` given and a Mesh,
    ``in_specs`` given (``given``: the mesh arguments that need mesh=; ``example``: a PartitionSpec and its layout)."""
    if mesh is None:
        raise ValueError(f"{name}(): {given} were given without mesh=; pass the jax.sharding.Mesh to run the op over")
    if not (hasattr(mesh, "axis_names") and hasattr(mesh, "shape")):
        raise ValueError(f"{name}(): mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if in_specs is None:
        raise ValueError(f"{name}(): mesh= needs in_specs=: the PartitionSpecs of (query, key, value) (one "
                         f"PartitionSpec for all three), e.g. {example}")


def tensor_specs(name: str, mesh, in_specs, tensors: tuple, rank: int, hint: str) -> tuple:
    """The specs of ``tensors`` (their names, each of ``rank`` dims) from ``in_specs`` (one PartitionSpec each, or one
    for all), each a tuple of one mesh-axes tuple per dim; every problem a ValueError naming it (``hint`` ends the
    message of a malformed ``in_specs``)."""
    names = ", ".join(tensors)
    if isinstance(in_specs, P):
        in_specs = (in_specs,) * len(tensors)
    if (not isinstance(in_specs, (tuple, list)) or len(in_specs) != len(tensors)
            or not all(isinstance(s, P) for s in in_specs)):
        raise ValueError(f"{name}(): in_specs must be the PartitionSpecs of ({names}), or one PartitionSpec for all "
                         f"{len(tensors)}, got {show(in_specs)}; {hint}")
    found = []
    for t, s in zip(tensors, in_specs):
        if len(s) > rank:
            raise ValueError(f"{name}(): in_specs for {t} has {len(s)} entries; {t} has {rank} dims")
        dims = []
        for e in tuple(s) + (None,) * (rank - len(s)):
            try:
                axes = axes_of(e)
            except TypeError:
                raise ValueError(f"{name}(): in_specs for {t}: {e!r} is not a mesh axis name, a tuple of them or "
                                 f"None") from None
            for a in axes:
                if a not in mesh.axis_names:
                    raise ValueError(f"{name}(): in_specs for {t} names mesh axis {a!r}, which the mesh does not have "
                                     f"(axes: {', '.join(map(str, mesh.axis_names))})")
            dims.append(axes)
        used = [a for axes in dims for a in axes]
        if len(used) != len(set(used)):
            raise ValueError(f"{name}(): in_specs for {t} uses a mesh axis twice: {show(s)}")
        found.append(tuple(dims))
    return tuple(found)


def show(specs) -> str:
    """Specs as P(...) whatever this JAX's repr of them."""
    if isinstance(specs, P):
        return f"P({', '.join(map(repr, specs))})"
    if isinstance(specs, (tuple, list)):
        return f"({', '.join(map(show, specs))})"
    return repr(specs)


def normal(specs):
    """Specs compared by what they cut: trailing Nones dropped, a one-axis tuple as the axis."""
    if isinstance(specs, P):
        entries = []
        for e in specs:
            try:
                entries.append(entry(axes_of(e)))
            except TypeError:
                entries.append(e)
        while entries and entries[-1] is None:
            entries.pop()
        return ("P", *entries)
    if isinstance(specs, (tuple, list)):
        return tuple(normal(s) for s in specs)
    return specs


def axis_size(axis_name) -> int:
    """The devices along a bound mesh axis; NameError where it is not bound (outside shard_map)."""
    size = getattr(lax, "axis_size", None)
    return size(axis_name) if size is not None else lax.psum(1, axis_name)


def context_mesh():
    """The mesh of ``with jax.set_mesh(mesh):`` (under ``jax.jit`` the abstract one) or of the older ``with mesh:``,
    None outside both."""
    for name in ("get_mesh", "get_abstract_mesh"):
        get = getattr(jax.sharding, name, None)
        try:
            mesh = get() if get is not None else None
        except ValueError:  # get_mesh under jit
            continue
        if mesh is not None and getattr(mesh, "axis_names", ()):
            return mesh
    try:
        from jax._src import mesh as mesh_lib  # `with mesh:` (deprecated): no public accessor

        mesh = mesh_lib.thread_resources.env.physical_mesh
    except (ImportError, AttributeError):
        return None
    return mesh if getattr(mesh, "axis_names", ()) else None


def mesh_with_axis(name: str, axis_name):
    """The context mesh (`context_mesh`) of a call on global arrays that cuts its sequence over ``axis_name``; a
    ValueError naming the function ``name`` (with its parentheses) where no mesh in scope has that axis."""
    mesh = context_mesh()
    if mesh is None or axis_name not in mesh.axis_names:
        where = "no mesh is in scope" if mesh is None else f"the mesh in scope has axes {tuple(mesh.axis_names)}"
        raise ValueError(f"{name}: axis_name={axis_name!r} is not a bound mesh axis ({where}): call it inside "
                         f"jax.shard_map over a mesh with that axis, or on global arrays under `with "
                         f"jax.set_mesh(mesh):` (or `with mesh:`)")
    return mesh

"""Device-varying types inside ``jax.shard_map``, and shard_map itself (docs/DESIGN.md §4, Transformations).

With ``check_vma`` on (shard_map's default) every value inside the map has a type that says which manual
mesh axes it varies over. A loop whose carry starts from a constant (invariant) and comes back varying, or a
kernel call whose declared outputs say nothing of the mesh, fails that check; these helpers give such values
the axes of the inputs they come from. Outside shard_map every value varies over no axis, so they change
nothing and add no operation.

JAX has spelt this API two ways, and the GPU host may run another JAX than CI: the type's
``manual_axis_type.varying`` with ``jax.lax.pcast(x, axes, to="varying")`` and
``ShapeDtypeStruct(manual_axis_type=ManualAxisType(varying=...))``, or the older ``vma`` with
``jax.lax.pvary`` and ``ShapeDtypeStruct(vma=...)``. Each is found by looking for it, never by version.
"""

from __future__ import annotations

import functools
import inspect

import jax


def typeof(x):
    """``x``'s abstract value (its type: shape, dtype, sharding, varying axes)."""
    typeof = getattr(jax, "typeof", None)
    return typeof(x) if typeof is not None else jax.core.get_aval(x)


def _axes_of_one(x) -> frozenset:
    if x is None or not hasattr(x, "dtype"):
        return frozenset()
    return aval_axes(typeof(x))


def aval_axes(aval) -> frozenset:
    """The mesh axes an abstract value (``typeof``'s, or a symbolic zero's ``aval``) varies over."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def varying_axes(*trees) -> frozenset:
    """The mesh axes any array leaf of ``trees`` varies over (empty outside shard_map)."""
    axes = frozenset()
    for leaf in jax.tree_util.tree_leaves(trees):
        axes |= _axes_of_one(leaf)
    return axes


def _cast(x, axes: tuple):
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def vary(tree, axes: frozenset):
    """``tree`` with every array leaf made to vary over ``axes`` too: a cast that moves no data, where a leaf did
    not. Its transpose sums over those axes, so a replicated input gets its gradient summed over the mesh."""

    def one(x):
        if x is None or not hasattr(x, "dtype"):
            return x
        missing = axes - _axes_of_one(x)
        return _cast(x, tuple(sorted(missing))) if missing else x

    if not axes:
        return tree
    return jax.tree_util.tree_map(one, tree)


def erase(tree):
    """``tree`` typed as varying over no mesh axis, its values unchanged (an identity whose type says so: no
    operation is emitted). For code that JAX can only trace on such values, such as Pallas's interpreters inside
    shard_map (``pallas.common``); give the results their axes back with ``vary``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if hasattr(x, "dtype")]
    if not arrays:
        return tree
    for i, x in zip(arrays, _erase_primitive().bind(*(leaves[i] for i in arrays))):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.cache
def _erase_primitive():
    """The identity primitive behind ``erase``, made on first use (importing ejgen registers nothing with JAX).
    A host callback would do the same, but JAX moves its arguments to CPU device 0, and inside a multi-device
    CPU program that transfer can wait forever on device 0."""
    from jax.extend.core import Primitive
    from jax.interpreters import batching, mlir

    erase_p = Primitive("ejgen_erase_varying")
    erase_p.multiple_results = True
    erase_p.def_impl(lambda *xs: xs)
    erase_p.def_abstract_eval(lambda *avals: [_invariant(a) for a in avals])
    mlir.register_lowering(erase_p, lambda ctx, *xs: list(xs))
    batching.primitive_batchers[erase_p] = lambda args, dims: (erase_p.bind(*args), dims)
    return erase_p


def _invariant(aval):
    """``aval`` varying over no mesh axis, all else kept (sharding, weak type, memory space)."""
    if getattr(aval, "manual_axis_type", None) is not None:
        from jax.sharding import ManualAxisType

        return aval.update(manual_axis_type=ManualAxisType())
    if getattr(aval, "vma", None) is not None:
        return aval.update(vma=frozenset())
    return aval


@functools.cache
def _struct_field() -> str | None:
    """The keyword of ``jax.ShapeDtypeStruct`` that states the varying axes, if this JAX has one."""
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    return next((name for name in ("manual_axis_type", "vma") if name in params), None)


def struct(shape, dtype, axes: frozenset) -> jax.ShapeDtypeStruct:
    """A kernel output's declared type, varying over ``axes`` (``pallas_call`` inside shard_map with
    ``check_vma`` refuses outputs that do not say; outside shard_map the field is not read)."""
    field = _struct_field()
    if field == "manual_axis_type":
        from jax.sharding import ManualAxisType

        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=ManualAxisType(varying=frozenset(axes)))
    if field == "vma":
        return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset(axes))
    return jax.ShapeDtypeStruct(shape, dtype)


def shard_map(f, *, mesh, in_specs, out_specs):
    """``jax.shard_map`` (``check_vma`` left on), or ``jax.experimental.shard_map.shard_map`` where a JAX has only
    that. The arguments are first laid out as ``in_specs`` say over the mesh's explicit axes (``jax.make_mesh``'s
    default in newer JAX): shard_map takes arrays on such axes only as they are already cut, and cuts the others
    itself."""
    run = getattr(jax, "shard_map", None)
    if run is None:
        from jax.experimental.shard_map import shard_map as run
    mapped = run(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return lambda *args: mapped(*_placed(args, in_specs, mesh))


def _placed(args, specs, mesh):
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    types = getattr(mesh, "axis_types", None) or ()
    axes = {name for name, kind in zip(mesh.axis_names, types) if explicit is not None and kind == explicit}
    if not axes:
        return args
    from jax.sharding import NamedSharding, PartitionSpec

    reshard = getattr(jax, "reshard", None) or jax.sharding.reshard

    def keep(entry):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        names = tuple(n for n in names if n in axes)
        return None if not names else names[0] if len(names) == 1 else names

    def one(spec, x):
        return reshard(x, NamedSharding(mesh, PartitionSpec(*map(keep, spec))))

    return jax.tree_util.tree_map(one, tuple(specs), args, is_leaf=lambda s: isinstance(s, PartitionSpec))

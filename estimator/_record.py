"""A small stand-in for `dataclasses.dataclass` (and `field`) for the estimator's record classes.

Importing `dataclasses` pulls in `inspect`, `ast`, `dis`, `tokenize`, ... which is a large share of the CLI's
start-up time. This builds the same __init__ / __repr__ / __eq__ (/ __hash__ and __setattr__ when frozen) as
`@dataclass` does for the options the estimator uses (default, default_factory, repr, compare; frozen), and a
lazy `__dataclass_fields__`, so `dataclasses.fields()` / `dataclasses.asdict()` still work on these classes (the
real module is imported only when something asks for them).
"""
from __future__ import annotations

_MISSING = object()


class Field:
    __slots__ = ("default", "default_factory", "repr", "compare", "name", "type")

    def __init__(self, default=_MISSING, default_factory=_MISSING, repr=True, compare=True):
        self.default = default
        self.default_factory = default_factory
        self.repr = repr
        self.compare = compare
        self.name = None
        self.type = None


def field(*, default=_MISSING, default_factory=_MISSING, repr=True, compare=True):
    return Field(default, default_factory, repr, compare)


class _LazyDataclassFields:
    """Class attribute `__dataclass_fields__`: real dataclasses.Field objects, built on first access."""

    def __init__(self, fields):
        self._fields = fields
        self._real = None

    def __get__(self, obj, cls):
        if self._real is None:
            import dataclasses
            real = {}
            for f in self._fields:
                kw = {"repr": f.repr, "compare": f.compare}
                if f.default is not _MISSING:
                    kw["default"] = f.default
                if f.default_factory is not _MISSING:
                    kw["default_factory"] = f.default_factory
                rf = dataclasses.field(**kw)
                rf.name, rf.type = f.name, f.type
                rf._field_type = dataclasses._FIELD
                real[f.name] = rf
            self._real = real
        return self._real


class FrozenInstanceError(AttributeError):
    pass


def _frozen_setattr(self, name, value):
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self, name):
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def _process(cls, frozen: bool):
    fields = []
    for base in reversed(cls.__mro__[1:]):
        fields += [f for f in getattr(base, "_record_fields", ()) if all(f.name != g.name for g in fields)]
    for name, ann in cls.__dict__.get("__annotations__", {}).items():
        if isinstance(ann, str) and ann.startswith("ClassVar"):
            continue
        v = cls.__dict__.get(name, _MISSING)
        f = v if isinstance(v, Field) else Field(default=v)
        f.name, f.type = name, ann
        if isinstance(v, Field):
            if f.default is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.default)
        fields = [g for g in fields if g.name != name] + [f]
    cls._record_fields = tuple(fields)

    glb = {"_MISSING": _MISSING, "__object_setattr": object.__setattr__}
    args, body = [], []
    for f in fields:
        if f.default_factory is not _MISSING:
            glb[f"_f_{f.name}"] = f.default_factory
            args.append(f"{f.name}=_MISSING")
            val = f"_f_{f.name}() if {f.name} is _MISSING else {f.name}"
        elif f.default is not _MISSING:
            glb[f"_d_{f.name}"] = f.default
            args.append(f"{f.name}=_d_{f.name}")
            val = f.name
        else:
            args.append(f.name)
            val = f.name
        body.append(f"__object_setattr(self, {f.name!r}, {val})" if frozen else f"self.{f.name} = {val}")
    if hasattr(cls, "__post_init__"):
        body.append("self.__post_init__()")
    src = f"def __init__(self, {', '.join(args)}):\n    " + ("\n    ".join(body) or "pass") + "\n"
    ns: dict = {}
    exec(src, glb, ns)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init

    rep = tuple(f.name for f in fields if f.repr)
    cmp = tuple(f.name for f in fields if f.compare)

    def __repr__(self):
        return f"{type(self).__qualname__}(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in rep) + ")"

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return tuple(getattr(self, n) for n in cmp) == tuple(getattr(other, n) for n in cmp)
        return NotImplemented

    __repr__.__qualname__ = f"{cls.__qualname__}.__repr__"
    if "__repr__" not in cls.__dict__:
        cls.__repr__ = __repr__
    if "__eq__" not in cls.__dict__:
        cls.__eq__ = __eq__
    if frozen:
        def __hash__(self):
            return hash(tuple(getattr(self, n) for n in cmp))
        cls.__hash__ = __hash__
        cls.__setattr__ = _frozen_setattr
        cls.__delattr__ = _frozen_delattr
    elif "__hash__" not in cls.__dict__ or cls.__dict__["__hash__"] is None:
        cls.__hash__ = None
    cls.__dataclass_fields__ = _LazyDataclassFields(fields)
    cls.__match_args__ = tuple(f.name for f in fields)
    return cls


def dataclass(cls=None, *, frozen: bool = False):
    if cls is None:
        return lambda c: _process(c, frozen)
    return _process(cls, frozen)


def fields(cls_or_obj) -> tuple:
    return (cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj))._record_fields


def asdict(obj) -> dict:
    """dataclasses.asdict for these records (nested records, lists, tuples and dicts are copied deeply)."""
    return _asdict_inner(obj)


_ATOMS = (str, int, float, bool, type(None))


def _asdict_inner(obj):
    if isinstance(obj, _ATOMS):  # immutable: deepcopy would return it unchanged (and cost the copy import)
        return obj
    if hasattr(type(obj), "_record_fields"):
        return {f.name: _asdict_inner(getattr(obj, f.name)) for f in type(obj)._record_fields}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[_asdict_inner(v) for v in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(_asdict_inner(v) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((_asdict_inner(k), _asdict_inner(v)) for k, v in obj.items())
    import copy
    return copy.deepcopy(obj)

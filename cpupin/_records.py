"""Records and named tuples at the cost of a plain class.

cpupin's values (:class:`~cpupin.Host`, :class:`~cpupin.Binding`, ...) are
frozen dataclasses to their users and to mypy, which sees
``dataclasses.dataclass`` and ``typing.NamedTuple`` here. At run time they
are made without either module: on a small VM, importing ``dataclasses``
(which imports ``inspect``) costs about 10 ms, ``typing`` about 4, and each
frozen dataclass about 0.8 ms more (it compiles its methods), while ``cpupin
exec`` must start in little more than Python itself (bench/RESULTS.md).

- :func:`record` makes a frozen class with what ``@dataclass(frozen=True)``
  gives: ``__init__`` by field (positional or keyword, defaults, default
  factories from :func:`field`), ``==`` and ``hash`` over the fields in
  order, the same ``repr``, ``__match_args__``, and
  ``dataclasses.FrozenInstanceError`` on assignment. ``dataclasses.fields``,
  ``replace``, ``asdict`` and ``is_dataclass`` work on it too: on first use
  they get the fields of a dataclass that ``dataclasses`` makes from the
  record's own.
- :data:`NamedTuple` is ``typing.NamedTuple``'s class syntax over
  ``collections.namedtuple``.
- :func:`replace` is ``dataclasses.replace`` for records, without the import.

tests/test_records.py holds each against the standard library's own.
"""

from __future__ import annotations

import collections

TYPE_CHECKING = False
if TYPE_CHECKING:
    from dataclasses import dataclass as record
    from dataclasses import field, replace
    from typing import NamedTuple
else:

    class _Factory:
        """A field's ``default_factory``, until :func:`record` takes it."""

        __slots__ = ("make",)

        def __init__(self, make):
            self.make = make

    def field(*, default_factory):
        """A field whose default each instance makes afresh (``dict``,
        ``list``): the one use of ``dataclasses.field`` records have."""
        if not callable(default_factory):
            raise TypeError(f"default_factory={default_factory!r} is not callable")
        return _Factory(default_factory)

    def record(*, frozen):
        """``@record(frozen=True)``: see the module's docstring."""
        if frozen is not True:
            raise TypeError("a record is frozen: @record(frozen=True)")
        return _make

    def replace(obj, /, **changes):
        """A copy of record ``obj`` with ``changes``, as
        ``dataclasses.replace`` makes it."""
        values = {name: getattr(obj, name) for name in obj._record_names}
        values.update(changes)
        return obj.__class__(**values)

    def _fields_of(cls):
        """The fields a class declares, in order: (names, defaults, factories)."""
        annotations = cls.__dict__.get("__annotations__", {})
        names, defaults, factories = [], {}, {}
        for name, kind in annotations.items():
            if str(kind).startswith(("ClassVar", "typing.ClassVar")):
                continue
            if name in cls.__dict__:
                value = cls.__dict__[name]
                if isinstance(value, _Factory):
                    factories[name] = value.make
                    delattr(cls, name)
                else:
                    defaults[name] = value
            elif defaults or factories:
                raise TypeError(
                    f"{cls.__qualname__}: field {name!r} without a default follows one with"
                )
            names.append(name)
        return tuple(names), defaults, factories

    def _make(cls):
        """``@record(frozen=True)``'s work: the fields read, the methods made
        and put on the class as dataclasses would."""
        for base in cls.__mro__[1:]:
            if "_record_names" in base.__dict__:
                raise TypeError(f"{cls.__qualname__}: a record does not derive from a record")
        names, defaults, factories = _fields_of(cls)
        made = {"__init__": _init_of(cls.__qualname__, names, defaults, factories), **_METHODS}
        for key, method in made.items():
            # As dataclasses: a class's own __init__, __repr__ and __eq__
            # stay (and a hash is made unless the class wrote one), and a
            # frozen class may not write __setattr__ or __delattr__.
            own = cls.__dict__.get(key)
            if own is not None and key in ("__setattr__", "__delattr__"):
                raise TypeError(f"Cannot overwrite attribute {key} in class {cls.__name__}")
            if own is None:
                setattr(cls, key, method)
        cls.__match_args__ = names
        cls._record_names = names
        for name in ("__dataclass_fields__", "__dataclass_params__"):
            setattr(cls, name, _DataclassView(name, defaults, factories))
        return cls

    def _init_of(qualname, names, defaults, factories):
        """A record's ``__init__``: the fields by position or name, the rest
        from their defaults, with the errors a dataclass's ``__init__`` gives."""
        count = len(names)
        known = frozenset(names)

        def __init__(self, *args, **kwargs):
            if len(args) > count:
                raise TypeError(
                    f"{qualname}.__init__() takes {count + 1} positional arguments but "
                    f"{len(args) + 1} were given"
                )
            values = dict(zip(names, args))
            for key in kwargs:
                if key in values:
                    raise TypeError(
                        f"{qualname}.__init__() got multiple values for argument {key!r}"
                    )
                if key not in known:
                    raise TypeError(
                        f"{qualname}.__init__() got an unexpected keyword argument {key!r}"
                    )
            values.update(kwargs)
            if len(values) < count:
                for name in names:
                    if name in values:
                        continue
                    if name in defaults:
                        values[name] = defaults[name]
                    elif name in factories:
                        values[name] = factories[name]()
                    else:
                        raise TypeError(
                            f"{qualname}.__init__() missing 1 required positional argument: "
                            f"{name!r}"
                        )
            self.__dict__.update(values)

        __init__.__qualname__ = f"{qualname}.__init__"
        return __init__

    # The methods every record shares: they read its fields' names from the
    # class (_record_names), as a dataclass's compare its fields in order.

    def _values(self):
        fields = self.__dict__
        return tuple([fields[name] for name in self._record_names])

    def _eq(self, other):
        if other.__class__ is self.__class__:
            return _values(self) == _values(other)
        return NotImplemented

    def _hash(self):
        return hash(_values(self))

    def _repr(self):
        inner = ", ".join(
            [f"{name}={value!r}" for name, value in zip(self._record_names, _values(self))]
        )
        return f"{self.__class__.__qualname__}({inner})"

    def _setattr(self, name, value):
        import dataclasses

        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def _delattr(self, name):
        import dataclasses

        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def _replace(self, /, **changes):
        return replace(self, **changes)

    _METHODS = {
        "__replace__": _replace,  # copy.replace, from Python 3.13
        "__eq__": _eq,
        "__hash__": _hash,
        "__repr__": _repr,
        "__setattr__": _setattr,
        "__delattr__": _delattr,
    }

    class _DataclassView:
        """``__dataclass_fields__`` (and ``__dataclass_params__``) of a record,
        made on first use: the fields of a dataclass that ``dataclasses``
        itself builds with the record's names, types and defaults, so that
        its functions see the record as one of theirs."""

        def __init__(self, name, defaults, factories):
            self.name = name
            self.defaults = defaults
            self.factories = factories

        def __get__(self, obj, cls):
            import dataclasses

            annotations = cls.__dict__.get("__annotations__", {})
            spec = []
            for name in cls._record_names:
                if name in self.defaults:
                    how = dataclasses.field(default=self.defaults[name])
                elif name in self.factories:
                    how = dataclasses.field(default_factory=self.factories[name])
                else:
                    how = dataclasses.field()
                spec.append((name, annotations.get(name, "object"), how))
            model = dataclasses.make_dataclass(cls.__name__, spec, frozen=True)
            type.__setattr__(cls, "__dataclass_fields__", model.__dataclass_fields__)
            type.__setattr__(cls, "__dataclass_params__", model.__dataclass_params__)
            return cls.__dict__[self.name]

    _RESERVED = frozenset(
        ("__new__", "__init__", "__slots__", "__getnewargs__", "_fields", "_field_defaults",
         "_make", "_replace", "_asdict", "_source")
    )  # fmt: skip
    _SKIP = frozenset(("__module__", "__annotations__", "__classcell__"))

    class _NamedTupleMeta(type):
        def __new__(mcls, typename, bases, ns):
            if not bases:  # NamedTuple itself
                return super().__new__(mcls, typename, bases, ns)
            if bases != (NamedTuple,):
                raise TypeError(f"{typename}: a NamedTuple derives from NamedTuple alone")
            annotations = ns.get("__annotations__", {})
            defaults = []
            for name in annotations:
                if name in ns:
                    defaults.append(ns[name])
                elif defaults:
                    raise TypeError(
                        f"{typename}: field {name!r} without a default follows one with"
                    )
            made = collections.namedtuple(
                typename, list(annotations), defaults=defaults, module=ns["__module__"]
            )
            for key, value in ns.items():
                if key in _RESERVED:
                    raise AttributeError(f"Cannot overwrite NamedTuple attribute {key}")
                if key not in _SKIP and key not in made._fields:
                    setattr(made, key, value)
            made.__annotations__ = dict(annotations)
            return made

    class NamedTuple(metaclass=_NamedTupleMeta):
        """``class X(NamedTuple): a: int; b: int = 0``, as with ``typing``'s."""


__all__ = ["NamedTuple", "field", "record", "replace"]

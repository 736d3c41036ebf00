"""cpupin's records and named tuples against the standard library's own:
for classes of any shape and calls of any kind, ``record`` behaves as
``dataclasses.dataclass(frozen=True)`` and ``NamedTuple`` as
``typing.NamedTuple``, and the records are what mypy is told they are."""

import copy
import dataclasses
import keyword
import pickle
import subprocess
import sys
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpupin import _records
from cpupin._records import NamedTuple, field, record, replace

NAMES = st.text("abcdefghij_", min_size=1, max_size=6).filter(
    lambda n: n.isidentifier() and not keyword.iskeyword(n) and not n.startswith("__")
)
VALUES = st.one_of(
    st.integers(-3, 3), st.text(max_size=3), st.frozensets(st.integers(0, 3), max_size=3)
)


@st.composite
def shapes(draw):
    """A class's fields: (name, kind, default) with kind "plain", "default"
    or "factory", every default after the plain ones."""
    names = draw(st.lists(NAMES, min_size=0, max_size=5, unique=True))
    cut = draw(st.integers(0, len(names)))
    out = []
    for i, name in enumerate(names):
        if i < cut:
            out.append((name, "plain", None))
        elif draw(st.booleans()):
            out.append((name, "default", draw(VALUES)))
        else:
            out.append((name, "factory", draw(st.sampled_from([dict, list, tuple]))))
    return out


def make(shape, ours):
    namespace = {"__annotations__": {name: "object" for name, _, _ in shape}}
    for name, kind, value in shape:
        if kind == "default":
            namespace[name] = value
        elif kind == "factory":
            namespace[name] = (field if ours else dataclasses.field)(default_factory=value)
    cls = type("R", (), namespace)
    return record(frozen=True)(cls) if ours else dataclasses.dataclass(frozen=True)(cls)


@st.composite
def calls(draw, shape):
    """Arguments for a constructor of ``shape``: mostly right, sometimes
    with too many, an unknown or a repeated name, or one missing."""
    names = [name for name, _, _ in shape]
    given_names = [n for n, kind, _ in shape if kind == "plain" or draw(st.booleans())]
    if draw(st.integers(0, 5)) == 0 and given_names:
        given_names.pop(draw(st.integers(0, len(given_names) - 1)))
    values = {n: draw(VALUES) for n in given_names}
    positional = draw(st.integers(0, len(names)))
    args = [values.pop(n) for n in names[:positional] if n in values]
    if len(args) < positional:  # a gap: the rest go by name
        values.update({n: draw(VALUES) for n in names[len(args) : positional] if n in values})
    kwargs = dict(values)
    trouble = draw(st.integers(0, 7))
    if trouble == 1:
        args.append(draw(VALUES))
        args += [draw(VALUES)] * len(names)
    elif trouble == 2:
        kwargs["zz_unknown"] = 1
    elif trouble == 3 and args:
        kwargs[names[0]] = draw(VALUES)
    return args, kwargs


def attempt(cls, args, kwargs):
    try:
        return cls(*args, **kwargs)
    except TypeError:
        return TypeError


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_record_is_a_frozen_dataclass(data):
    shape = data.draw(shapes())
    ours, theirs = make(shape, True), make(shape, False)
    args, kwargs = data.draw(calls(shape))
    a, b = attempt(ours, args, kwargs), attempt(theirs, args, kwargs)
    assert (a is TypeError) == (b is TypeError), (shape, args, kwargs)
    if a is TypeError:
        return
    assert repr(a) == repr(b)
    assert a.__match_args__ == b.__match_args__
    assert dataclasses.is_dataclass(a) and dataclasses.is_dataclass(ours)
    assert [f.name for f in dataclasses.fields(a)] == [f.name for f in dataclasses.fields(b)]
    assert dataclasses.asdict(a) == dataclasses.asdict(b)
    assert dataclasses.astuple(a) == dataclasses.astuple(b)
    twin = attempt(ours, args, kwargs)
    assert a == twin and not (a != twin) and a != b  # another class is never equal
    try:
        expected = hash(b)
    except TypeError:
        with pytest.raises(TypeError):
            hash(a)
    else:
        assert hash(a) == expected
    for name, _, _ in shape:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(a, name, 1)
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(a, name)
        changed = data.draw(VALUES)
        assert repr(replace(a, **{name: changed})) == repr(
            dataclasses.replace(b, **{name: changed})
        )
        assert dataclasses.replace(a, **{name: changed}) == replace(a, **{name: changed})
        assert a.__replace__(**{name: changed}) == replace(a, **{name: changed})
    assert copy.deepcopy(a) == a and copy.copy(a) == a
    # A factory's default is made afresh for each instance, as dataclasses
    # makes it (a tuple() is shared by Python itself).
    passed = {name for name, _, _ in shape[: len(args)]} | set(kwargs)
    for name, kind, make_default in shape:
        if kind == "factory" and name not in passed and make_default is not tuple:
            assert getattr(a, name) == make_default()
            assert getattr(a, name) is not getattr(twin, name)


def test_a_records_own_methods_stay_and_classvars_are_not_fields():
    @record(frozen=True)
    class Own:
        limit: "typing.ClassVar[int]" = 3
        a: int
        b: int = 2

        def __repr__(self):
            return "mine"

        @property
        def total(self):
            return self.a + self.b

    assert Own._record_names == ("a", "b")
    assert repr(Own(1)) == "mine" and Own(1).total == 3 and Own.limit == 3
    with pytest.raises(TypeError, match="__setattr__"):

        @record(frozen=True)
        class Writes:
            a: int

            def __setattr__(self, name, value):
                pass


def test_a_record_refuses_what_it_does_not_do():
    with pytest.raises(TypeError, match="frozen"):
        record(frozen=False)
    with pytest.raises(TypeError, match="without a default follows"):

        @record(frozen=True)
        class Bad:
            a: int = 1
            b: int

    with pytest.raises(TypeError, match="not callable"):
        field(default_factory=3)


@st.composite
def tuple_shapes(draw):
    names = draw(st.lists(NAMES.filter(lambda n: not n.startswith("_")), max_size=5, unique=True))
    cut = draw(st.integers(0, len(names)))
    return [(n, None if i < cut else draw(VALUES)) for i, n in enumerate(names)]


def make_tuple(shape, base):
    namespace = {
        "__annotations__": {name: "object" for name, _ in shape},
        "__doc__": "A doc.",
        "__module__": __name__,
        "__qualname__": "T",
        "twice": lambda self: self + self,
    }
    namespace.update({name: value for name, value in shape if value is not None})
    return type(base)("T", (base,), namespace) if base is NamedTuple else _typing_tuple(namespace)


def _typing_tuple(namespace):
    return typing.NamedTupleMeta("T", (typing._NamedTuple,), dict(namespace))


@settings(max_examples=200, deadline=None)
@given(tuple_shapes(), st.data())
def test_namedtuple_is_typings(shape, data):
    ours, theirs = make_tuple(shape, NamedTuple), make_tuple(shape, None)
    assert ours._fields == theirs._fields
    assert ours._field_defaults == theirs._field_defaults
    assert ours.__doc__ == theirs.__doc__ == "A doc."
    assert ours.__qualname__ == theirs.__qualname__ and ours.__module__ == theirs.__module__
    # typing wraps annotations written as text in ForwardRef; the names agree.
    assert list(ours.__annotations__) == list(theirs.__annotations__)
    values = [data.draw(VALUES) for name, default in shape if default is None]
    a, b = ours(*values), theirs(*values)
    assert repr(a) == repr(b) and a == b and hash(a) == hash(b) and a.twice() == b.twice()
    assert a._asdict() == b._asdict()
    if shape:
        name = shape[0][0]
        assert a._replace(**{name: 9}) == b._replace(**{name: 9})
    assert copy.deepcopy(a) == a


@record(frozen=True)
class Kept:
    a: int
    b: frozenset[int] = frozenset()
    c: dict[str, int] = field(default_factory=dict)


class Pair(NamedTuple):
    a: int
    b: int = 2


def test_records_and_tuples_pickle_as_the_standard_librarys():
    for value in (Kept(1, frozenset({2}), {"x": 3}), Pair(1)):
        back = pickle.loads(pickle.dumps(value))
        assert back == value and type(back) is type(value)


def test_namedtuple_refuses_what_typing_refuses():
    with pytest.raises(TypeError, match="without a default follows"):

        class Bad(NamedTuple):
            a: int = 1
            b: int

    with pytest.raises(AttributeError, match="_replace"):

        class Overwrites(NamedTuple):
            a: int

            def _replace(self):
                pass

    with pytest.raises(TypeError, match="derives from NamedTuple alone"):

        class Mixed(NamedTuple, dict):
            a: int


def test_importing_cpupin_imports_neither_dataclasses_nor_typing():
    """What the module is for: neither is on ``import cpupin``'s or ``cpupin
    exec``'s path (each costs a start milliseconds)."""
    probe = (
        "import sys\n"
        "import cpupin, cpupin.cli.bind, cpupin.act.binding, cpupin.pools.limits\n"
        "cpupin.Host, cpupin.Binding, cpupin.CpuPlan, cpupin.PoolLimits\n"
        "print(sorted(m for m in ('dataclasses', 'typing', 'inspect', 'argparse') "
        "if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_mypy_is_told_the_standard_librarys_names():
    """mypy reads the TYPE_CHECKING branch: the decorators it checks records
    with are dataclasses' and typing's own."""
    source = _records.__loader__.get_source(_records.__name__)
    assert "from dataclasses import dataclass as record" in source
    assert "from typing import NamedTuple" in source

"""CPU lists and masks: strict parsing, the kernel's format, round trips past
1,024 and 4,096 CPUs, and what a bad list says."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin import format_cpulist, parse_cpulist, parse_cpumask
from cpupin.cpulist import MAX_CPUS, format_cpumask
from tests.support.strategies import cpu_ranges, cpu_sets


@given(st.one_of(cpu_sets, cpu_ranges()))
def test_parse_of_format_is_identity(cpus):
    """parse_cpulist(format_cpulist(s)) == s, past 1024 and 4096 CPUs too."""
    assert parse_cpulist(format_cpulist(cpus)) == cpus


@given(st.one_of(cpu_sets, cpu_ranges()))
def test_format_writes_ranges_as_the_kernel_does(cpus):
    """format_cpulist writes sorted, maximal runs: no two items could merge."""
    text = format_cpulist(cpus)
    items = [tuple(map(int, item.split("-"))) for item in text.split(",")] if text else []
    bounds = [(i[0], i[-1]) for i in items]
    for (_, last), (first, _) in zip(bounds, bounds[1:]):
        assert first > last + 1
    assert all(len(i) == 1 or i[0] < i[1] for i in items)


def _mask_text(cpus, words):
    value = sum(1 << c for c in cpus)
    return ",".join(f"{(value >> (32 * i)) & 0xFFFFFFFF:08x}" for i in reversed(range(words)))


@given(cpu_sets, st.integers(0, 4))
def test_hex_masks_of_any_width(cpus, extra):
    """A sysfs mask of any number of words reads back to its CPUs."""
    words = (max(cpus, default=0) // 32) + 1 + extra
    assert parse_cpumask(_mask_text(cpus, words)) == cpus
    assert parse_cpumask(_mask_text(cpus, words) + "\n") == cpus


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("0-3,8-11", {0, 1, 2, 3, 8, 9, 10, 11}),
        ("0-3,8-11\n", {0, 1, 2, 3, 8, 9, 10, 11}),
        ("", set()),
        ("\n", set()),
        ("5", {5}),
        ("3,1", {1, 3}),
        (" 0-1 ", {0, 1}),
        ("4095-4097", {4095, 4096, 4097}),
    ],
)
def test_cpulists_the_kernel_writes(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize(
    "text",
    [
        "3-1",
        "0-7:2",
        "a",
        "0,,1",
        "-1",
        "1-",
        "+1",
        "0x5",
        "1.0",
        "0 - 3",
        "１",
        "٣",
        "0-3;5",
        f"0-{MAX_CPUS}",
        "0,",
        ",0",
    ],
)
def test_bad_cpulists_raise_valueerror_quoting_the_text(text):
    with pytest.raises(ValueError) as info:
        parse_cpulist(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("ff", set(range(8))),
        ("00000001,00000000", {32}),
        ("1,0", {32}),
        ("", set()),
        ("00000000,00000000,80000000\n", {31}),
        ("F0", {4, 5, 6, 7}),
    ],
)
def test_cpumasks_the_kernel_writes(text, cpus):
    assert parse_cpumask(text) == cpus


@pytest.mark.parametrize("text", ["0x5", "g", "123456789", "ff,", ",ff", "ff ff", "-1", "٣"])
def test_bad_cpumasks_raise_valueerror_quoting_the_text(text):
    with pytest.raises(ValueError) as info:
        parse_cpumask(text)
    assert repr(text) in str(info.value)


@given(st.text(max_size=30))
def test_any_text_is_a_set_or_a_valueerror(text):
    """No input gives another exception than ValueError."""
    for parse in (parse_cpulist, parse_cpumask):
        try:
            result = parse(text)
        except ValueError:
            continue
        assert all(isinstance(c, int) and 0 <= c < MAX_CPUS for c in result)


@pytest.mark.parametrize("bad", [[-1], [True], [1.5], ["1"], [None]])
def test_format_refuses_what_is_not_a_cpu(bad):
    with pytest.raises(ValueError, match="not a CPU number"):
        format_cpulist(bad)


def test_parse_refuses_what_is_not_text():
    with pytest.raises(TypeError, match="str"):
        parse_cpulist(b"0-3")


@given(cpu_sets, st.integers(0, 4))
def test_format_cpumask_is_what_parse_cpumask_reads(cpus, words):
    text = format_cpumask(cpus, words)
    assert parse_cpumask(text) == cpus
    assert all(len(word) == 8 for word in text.split(","))
    assert len(text.split(",")) == max(words, 1, (max(cpus, default=-1) + 32) // 32)

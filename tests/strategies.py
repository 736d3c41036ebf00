"""Hypothesis strategies shared by the tests."""

from hypothesis import strategies as st

#: CPU numbers well past 1024 and 4096, where fixed cpu_set_t code breaks.
cpu_numbers = st.one_of(
    st.integers(0, 255),
    st.integers(1000, 1100),
    st.integers(4090, 4200),
    st.integers(0, 65535),
)

cpu_sets = st.frozensets(cpu_numbers, max_size=300)


@st.composite
def cpu_ranges(draw):
    """Sets made of a few long runs, as real masks are."""
    cpus = set()
    for _ in range(draw(st.integers(0, 6))):
        start = draw(cpu_numbers)
        cpus.update(range(start, min(start + draw(st.integers(1, 200)), 65536)))
    return frozenset(cpus)

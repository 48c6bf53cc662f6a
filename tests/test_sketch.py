"""`CountMinSketch`: estimates, saturation, halving, arguments."""

from collections import Counter

import numpy as np
import pytest

from tests.helpers import key
from tiering.eviction.sketch import CountMinSketch


def test_an_estimate_is_never_below_the_true_count():
    rng = np.random.default_rng(0)
    sketch = CountMinSketch(64, window=10**9)  # narrow: many collisions
    sightings = [key(int(i)) for i in rng.integers(0, 500, 3000)]
    for at in range(0, len(sightings), 100):
        sketch.add_many(sightings[at : at + 100])
    truth = Counter(sightings)
    assert all(sketch.count(k) >= n for k, n in truth.items())
    assert any(sketch.count(k) > n for k, n in truth.items())  # 64 cells: some collide


def test_a_wide_sketch_counts_exactly_and_a_key_listed_twice_counts_twice():
    sketch = CountMinSketch(1 << 16, window=10**9)
    assert sketch.add_many([key(1), key(2), key(1)]) == [1, 1, 2]
    assert sketch.add(key(1)) == 3 and sketch.count(key(3)) == 0
    assert sketch.add_many([]) == [] and sketch.estimate_many([key(1), key(2)]) == [3, 1]


def test_counters_saturate_and_halve_every_window():
    sketch = CountMinSketch(1 << 10, window=30, max_count=15)
    assert sketch.add_many([key(1)] * 20) == [*range(1, 16), 15, 15, 15, 15, 15]  # saturated at 15
    assert sketch.add_many([key(2)] * 9)[-1] == 9  # 29 increments
    assert sketch.add(key(2)) == 10  # the 30th: read, then every counter halved
    assert (sketch.count(key(1)), sketch.count(key(2))) == (7, 5)


@pytest.mark.parametrize(("width", "window", "top"), [(0, 1, 9), (48, 1, 9), (2**33, 1, 9), (16, 0, 9), (16, 1, 256)])
def test_bad_arguments_are_refused(width, window, top):
    with pytest.raises(ValueError):
        CountMinSketch(width, window, top)

"""Seeds derived from tuples of integers: every random draw of a run is a function of a few numbers.

numpy's SeedSequence hashes the tuple, so nearby tuples give unrelated streams
((seed, epoch + 1) is not (seed + 1, epoch)), and `stream` keeps apart draws of
different purposes whose tuples happen to coincide (the sampler's (seed,
epoch) and batch mixing's (seed, step)).
"""

from __future__ import annotations

import numpy as np

MIXING = 1  # the stream of batch mixing's (seed, step) draws
CALIBRATION = 4  # the EMA's BatchNorm sample (loaders.calibration_loader); semi.py's streams are 2 and 3


def derived_seed(*keys: int, stream: int | None = None) -> int:
    """A 32-bit seed that depends on every key, in order, and on `stream`."""
    spawn_key = () if stream is None else (stream,)
    return int(np.random.SeedSequence(list(keys), spawn_key=spawn_key).generate_state(1)[0])

"""Benchmark-only emulation of slower ranks on one machine (heterogeneous clusters on a laptop).

    python main.py --rank-speed 0=0.5 ...            # rank 0 generates and trains at half speed
    python tools/bench.py --quick --hetero 0=0.5     # measured next to simulate.py's prediction

`--rank-speed RANK=FACTOR,...` (FACTOR in (0, 1]) pads every timed op of that rank -- generating a
fragment (rollout or TAG) and training a fragment -- with sleep((1 / FACTOR - 1) * elapsed), so the
op takes elapsed / FACTOR. This is an EMULATION for the benchmark only: the sleeping rank frees its
core instead of computing, and only the padded ops slow down (transfers, the optimizer step and
publishing keep their speed), exactly what simulate.py's Cluster.rank_speed models. It says
nothing about how a real slower GPU behaves beyond "each op takes 1/FACTOR times as long".

API for the rank loops: `speed = emulate.speed_of(cfg.rank_speed, rank)` once, then
`with emulate.paced(speed): <the op>` inside the op's trace span (the span then shows the slow op).
"""
from __future__ import annotations

import contextlib
import math
import time


def parse_rank_speed(spec: str | None) -> dict[int, float]:
    """"0=0.5,2=0.25" -> {0: 0.5, 2: 0.25}; None or "" -> {}. Raises ValueError naming the bad part."""
    speeds = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        rank, sep, factor = part.partition("=")
        try:
            rank_i, factor_f = int(rank), float(factor)
        except ValueError:
            raise ValueError(f"--rank-speed {spec!r}: {part!r} is not RANK=FACTOR "
                             "(e.g. 0=0.5: rank 0 at half speed)") from None
        if not sep or not (math.isfinite(factor_f) and 0 < factor_f <= 1):
            raise ValueError(f"--rank-speed {spec!r}: the factor of rank {rank_i} must be in (0, 1] "
                             f"(ranks can only be slowed), got {factor!r}")
        if rank_i in speeds:
            raise ValueError(f"--rank-speed {spec!r}: rank {rank_i} is given twice")
        speeds[rank_i] = factor_f
    return speeds


def check_rank_speed(spec: str | None, world_size: int) -> dict[int, float]:
    """Parse and check the ranks exist; the config validation calls this before spawning."""
    speeds = parse_rank_speed(spec)
    bad = [r for r in speeds if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"--rank-speed {spec!r}: rank {bad[0]} does not exist "
                         f"(ranks are 0..{world_size - 1})")
    return speeds


def speed_of(spec: str | None, rank: int) -> float:
    """This rank's factor (1.0 when not slowed)."""
    return parse_rank_speed(spec).get(rank, 1.0)


@contextlib.contextmanager
def paced(speed: float):
    """Run the body, then sleep so that it took elapsed / speed in all (no-op at speed 1)."""
    if speed >= 1.0:
        yield
        return
    start = time.perf_counter()
    yield
    time.sleep((1.0 / speed - 1.0) * (time.perf_counter() - start))

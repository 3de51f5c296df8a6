"""How many threads a step of one row gets, learned from the steps as they are served.

A step of one token streams the weights once, and on some CPUs one core draws most of the memory
bandwidth. When the model's threads take every CPU, TorchServe's frontend and the client share
those cores, and any slice they take from one of llama.cpp's lockstep threads stalls all of them;
one thread fewer leaves them a core. Which wins depends on what the frontend costs a token on that
host, which no timing at load (in-process, no frontend) sees: on a 2-vCPU Zen 4 EPYC one thread,
1.1-1.3x slower in-process, served one stream faster (67.4 -> 83.9 tokens/s); on a 2-vCPU Zen 5
EPYC, where a load-time probe read one thread 1.20-1.45x slower, two threads served one stream
1.12x as fast (bench model, ``scripts.bench.ab_served``, both start orders). So
:class:`OneRowThreadTuner` tries both while serving and keeps the one whose steps come faster.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)


class OneRowThreadTuner:
    """Alternates the thread count of one-row steps between ``candidates`` in blocks of ``block``
    steps, ``rounds`` times, and keeps the count whose steps came at the shorter median interval;
    it checks again after ``recheck_after`` more one-row steps, as the host's load moves.

    At the end of any round, a count whose median is ``clear_ratio`` times another's ends the trial
    early: each step on it costs that much, and no further block would change the verdict. Beyond
    the AMX Xeon's cache (a 2 GB bf16 GGUF) one thread took 1.8x as long a step, and the full trial
    cost a stream's first 48 tokens 1.3x their time; on the tiny model one thread came 2.5x faster.

    A step's interval runs from its start to the next step's start, so it holds what the serving
    around it costs (the frontend's round trip, the streaming, a stalled thread), not only the
    compute. Only a one-row step followed by another counts: a prompt, a step of several rows or an
    idle wait in between says nothing about the thread count of steps of one row.
    """

    def __init__(self, candidates: Sequence[int], block: int = 6, rounds: int = 3, recheck_after: int = 2048,
                 clear_ratio: float = 1.5, clock: Callable[[], float] = time.perf_counter):
        if len(set(candidates)) < 2:
            raise ValueError(f"candidates: need two different thread counts, got {list(candidates)}")
        if block < 1 or rounds < 1 or recheck_after < 1:
            raise ValueError("block, rounds and recheck_after must be >= 1")
        if not clear_ratio > 1:
            raise ValueError(f"clear_ratio must be > 1, got {clear_ratio}")
        self.candidates = tuple(candidates)
        self.block, self.rounds, self.recheck_after, self.clock = block, rounds, recheck_after, clock
        self.clear_ratio = clear_ratio
        #: the thread count of the next step of one row
        self.current = self.candidates[0]
        #: each decision: the chosen count and each count's median interval (seconds)
        self.decisions: List[Tuple[int, Dict[int, float]]] = []
        self._previous: Optional[Tuple[float, int]] = None  # (start, threads) of the last step, if one row
        self._start_trial()

    @property
    def trying(self) -> bool:
        """Whether the counts are being compared now (else ``current`` is the one kept)."""
        return bool(self._plan)

    def threads_for_step(self, one_row: bool) -> int:
        """Call as each step starts: the thread count for it (it matters only for a step of one row)."""
        now = self.clock()
        if one_row and self._previous is not None:
            started, threads = self._previous
            self._record(threads, now - started)
        self._previous = (now, self.current) if one_row else None
        return self.current

    def _start_trial(self) -> None:
        order = (self.current,) + tuple(c for c in self.candidates if c != self.current)
        self._plan = [threads for _ in range(self.rounds) for threads in order]
        self._samples: Dict[int, List[float]] = {threads: [] for threads in self.candidates}
        self._left_in_block = self.block
        self._since_decision = 0
        self.current = self._plan[0]

    def _record(self, threads: int, interval: float) -> None:
        if not self._plan:
            self._since_decision += 1
            if self._since_decision >= self.recheck_after:
                self._start_trial()
            return
        self._samples[threads].append(interval)
        self._left_in_block -= 1
        if self._left_in_block:
            return
        self._plan.pop(0)
        self._left_in_block = self.block
        if self._plan and not self._clear_winner():
            self.current = self._plan[0]
        else:
            self._decide()

    def _medians(self) -> Dict[int, float]:
        return {threads: statistics.median(times) for threads, times in self._samples.items()}

    def _clear_winner(self) -> bool:
        """At the end of a round (every count has had as many blocks), whether one count's median is
        ``clear_ratio`` times another's."""
        if len(self._plan) % len(self.candidates):
            return False
        medians = self._medians()
        return max(medians.values()) >= self.clear_ratio * min(medians.values())

    def _decide(self) -> None:
        medians = self._medians()
        self.current = min(medians, key=medians.get)
        self._plan = []
        self.decisions.append((self.current, medians))
        logger.info("decode_threads auto: one-row steps as served came every %s (medians of %d); %d for one token",
                    ", ".join(f"{1e3 * medians[t]:.2f} ms on {t} thread{'s' * (t > 1)}" for t in self.candidates),
                    len(self._samples[self.current]), self.current)

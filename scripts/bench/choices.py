"""What each process of a bench run chose at load: the backend's measured choices, as it logged them.

The torch backend times some of its kernels against each other when it loads (the bf16 prompt products,
the pair panels, float32 linears, prompt attention, the one-row prefetch) and logs each decision as one
line. Each process decides for itself, so the bench process and each served worker may differ; one that
loaded on the slower side explains a ratio that moved between runs (an Emerald Rapids Xeon had taken
float32 prompt products, and so no pair panels, in 4 of 29 loads, and served 8 streams at 0.82x).
"""
from __future__ import annotations

import logging
from typing import List

#: The start of each decision line of ``llama_engine``'s loggers.
DECISIONS = ("bf16 prompt products,", "bf16 weights in pair panels,", "float32 linears,", "prompt attention,",
             "native linear, one row", "bf16 linears on AMX tiles,", "flash_attn auto:", "decode_threads auto:")
#: Those of the decisions made while serving, not at load: the llamacpp backend's thread count for
#: steps of one row (``llama_engine.backends.step_threads``).
SERVING_DECISIONS = ("decode_threads auto: one-row steps",)
#: What TorchServe puts before each line a worker logs.
WORKER_PREFIX = "MODEL_LOG - "


def is_decision(message: str) -> bool:
    return message.startswith(DECISIONS)


def choices_in_log(text: str, serving: bool = False) -> List[str]:
    """The decision lines of a worker's ``model_log.log``, in order, without TorchServe's prefixes: those
    made at load, or (``serving``) those made while serving."""
    lines = (line.split(WORKER_PREFIX, 1)[-1].strip() for line in text.splitlines())
    return [line for line in lines if is_decision(line) and line.startswith(SERVING_DECISIONS) == serving]


class ChoiceRecorder(logging.Handler):
    """Keeps the decision lines that this process's ``llama_engine`` loggers emit while it is attached.

    Attached, it is the handler that keeps logging's last resort from printing those loggers' warnings
    where nothing else handles them, so it hands those on to it: the bench prints what it printed before.
    """

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: List[str] = []
        self.logger = logging.getLogger("llama_engine")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if is_decision(message):
            self.lines.append(message)
        elif record.levelno >= logging.WARNING and not logging.getLogger().handlers and logging.lastResort:
            logging.lastResort.handle(record)

    def __enter__(self) -> "ChoiceRecorder":
        self._level = self.logger.level
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)

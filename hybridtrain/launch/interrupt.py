"""A Ctrl-C that always reaches the controller's ``except KeyboardInterrupt``.

Python raises ``KeyboardInterrupt`` in whatever Python code runs when SIGINT arrives. Inside a weakref
callback or a ``__del__`` (datasets and pyarrow run many while tokenizing) the exception cannot
propagate: Python prints ``Exception ignored in ...`` with a traceback and carries on, and the run
would tokenize, cache and train as if no Ctrl-C had come (seen in ``tests/dist/test_data_errors.py``).
:func:`delivered` catches that case in ``sys.unraisablehook`` and raises the interrupt again in the
main thread (``_thread.interrupt_main``, from a timer thread), silently.
"""
from __future__ import annotations

import _thread
import sys
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def delivered() -> Iterator[None]:
    """Within the block, a ``KeyboardInterrupt`` Python could only report as unraisable is raised again
    in the main thread; every other unraisable exception goes to the previous hook."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # From another thread, once this hook has returned: raised here, it would be unraisable again.
            threading.Timer(0.01, _thread.interrupt_main).start()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous

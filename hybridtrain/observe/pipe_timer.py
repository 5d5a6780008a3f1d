"""Time every instruction DeepSpeed's pipeline engine executes (forward, backward, send/receive...).

``PipelineEngine._exec_schedule`` looks each instruction's handler up in ``self._INSTRUCTION_MAP``
(a class attribute: instruction class -> unbound method) and binds it to the engine. Setting an
*instance* attribute of the same name with wrapped handlers times one engine without patching
DeepSpeed's class, so other engines and DeepSpeed itself are untouched. DeepSpeed's own
``wall_clock_breakdown`` timers cover only send/receive and print to stdout; these feed the
metrics and the timeline instead.
"""
from __future__ import annotations

from typing import Any, Callable

from hybridtrain.observe.clock import StepClock

_KIND_OF = {"LoadMicroBatch": "load", "ForwardPass": "forward", "BackwardPass": "backward",
            "SendActivation": "send_act", "RecvActivation": "recv_act", "SendGrad": "send_grad",
            "RecvGrad": "recv_grad", "ReduceGrads": "reduce_grads", "ReduceTiedGrads": "reduce_tied",
            "OptimizerStep": "optimizer"}
"""DeepSpeed instruction class name -> span kind (``hybridtrain.observe.clock.KINDS``)."""


def _timed(kind: str, handler: Callable[..., Any], clock: StepClock) -> Callable[..., Any]:
    def run(engine, **kwargs):
        if not clock.active:
            return handler(engine, **kwargs)
        span = clock.open(kind)
        try:
            return handler(engine, **kwargs)
        finally:
            clock.close(span)

    run.__name__ = getattr(handler, "__name__", kind)
    return run


def instrument(engine, clock: StepClock) -> None:
    """Route every pipeline instruction of ``engine`` (a ``PipelineEngine``) through ``clock``.

    An instruction class this module does not know is timed under its lower-cased class name
    (counted in no category), so a newer DeepSpeed schedule still runs.
    """
    table = type(engine)._INSTRUCTION_MAP
    engine._INSTRUCTION_MAP = {cls: _timed(_KIND_OF.get(cls.__name__, cls.__name__.lower()), fn, clock)
                               for cls, fn in table.items()}

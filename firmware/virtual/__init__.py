"""The Python virtual board: the C agent's behaviour in Python, bit for bit.

``board`` is the agent (the protocol state machine and the numeric work), ``cli`` the
serve loop and ``qsched board`` command, ``latency`` the STM32N6 latency model and
``faults`` the injected misbehaviour used by the fault tests.
"""

"""A digits-max reward that holds a run's last steps while a file exists.

tests/e2e/test_attacks.py attacks a run while it trains. How long the attack takes against how long
the run takes depends on the machine: on a fast one the run could end first and the attack would
prove nothing (and wait out its timeouts). This reward lets the run train at its own pace, but from
sample ``STREAMRL_TEST_HOLD_AFTER`` on (counted in this score process) it waits while the file
``STREAMRL_TEST_HOLD_FILE`` exists: the attacker creates it before the run starts and removes it
when it is done. Without the file it is digits-max, so it does not change what the run learns.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamrl.tasks.rewards import digits_max

HOLD_FILE = "STREAMRL_TEST_HOLD_FILE"
HOLD_AFTER = "STREAMRL_TEST_HOLD_AFTER"
HOLD_LIMIT_S = 120.0  # a held run that is never released fails its sample instead of hanging the test

_lock = threading.Lock()
_scored = 0


def digits_max_held(prompt: str, response: str, answer: str, response_ids: Sequence[int] = (), **_: Any) -> float:
    global _scored
    with _lock:
        _scored += 1
        held = _scored > int(os.environ.get(HOLD_AFTER, "0"))
    hold = os.environ.get(HOLD_FILE)
    if held and hold:
        deadline = time.monotonic() + HOLD_LIMIT_S
        while Path(hold).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{hold} still exists after {HOLD_LIMIT_S:.0f} s: nobody released the run")
            time.sleep(0.01)
    return digits_max(prompt, response, answer, response_ids)

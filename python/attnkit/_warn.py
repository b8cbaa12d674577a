"""One warning per reason per process, thread-safe: how the drop-ins and integrations say
that a call went to their framework's own kernel, and why."""

import sys
import threading
import warnings


class WarnOnce:
    """`warn(reason)` warns "<what>: <reason>; <fallback>" the first time a reason is seen.
    `reasons` holds those already warned (a test may discard one to see it again)."""

    def __init__(self, what, fallback):
        self._what = what
        self._fallback = fallback
        self._lock = threading.Lock()
        self.reasons = set()

    def __call__(self, reason):
        torch = sys.modules.get("torch")
        if torch is not None and torch.compiler.is_compiling():
            return  # no warning while torch.compile traces: dynamo cannot trace the lock
        with self._lock:
            if reason in self.reasons:
                return
            self.reasons.add(reason)
        # 1: here, 2: the function that fell back, 3: its caller.
        warnings.warn(f"{self._what}: {reason}; {self._fallback}", stacklevel=3)

"""The one exception diffkit raises for bad input: it says which side, which phase, and where."""
from __future__ import annotations


class DiffkitError(Exception):
    """A problem with a user's file or model.

    side:  "reference" | "candidate" | "" (not side-specific)
    phase: "read" | "parse" | "import" | "build" | "init" | "inputs" | "forward" | "capture" | "compare"
    """

    def __init__(self, side: str, phase: str, message: str, where: str = "", detail: str = ""):
        self.side = side
        self.phase = phase
        self.message = message
        self.where = where
        self.detail = detail
        super().__init__(str(self))

    def __str__(self) -> str:
        head = f"{self.side} " if self.side else ""
        loc = f" ({self.where})" if self.where else ""
        return f"{head}{self.phase} failed{loc}: {self.message}"

    def to_dict(self) -> dict:
        return {"side": self.side, "phase": self.phase, "message": self.message, "stage": self.where,
                "traceback": self.detail}


# diffkit's exit codes, defined once (the CLI's, a suite's, the supervisor's): a diff's by its verdict, and 3 for
# an internal error (diffkit's own fault, never the user's: its traceback is printed)
EXIT = {"match": 0, "diverged": 1, "error": 2}
INTERNAL = 3

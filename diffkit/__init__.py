"""diffkit: find the first stage where a hand-written kernel stops matching its PyTorch reference."""
from .capture import Record, Trace, capture, tap
from .errors import DiffkitError
from .load import LoadedPair, WeightReport, load_pair
from .options import Options, Tolerance
from .compare import compare, compare_traces, diff_files
from .result import Finding, Result, Stage
from . import testing

__version__ = "0.1.0"
__all__ = ["capture", "tap", "load_pair", "compare", "compare_traces", "diff_files", "testing", "Result", "Stage",
           "Finding", "Record", "Trace", "LoadedPair", "WeightReport", "DiffkitError", "Options", "Tolerance"]

"""A/B of the streaming diff of the 24-block transformer (CUDA, 40G), diffkit imported from the folder
given: `python bench/ab_stream.py OLD_ROOT NEW_ROOT ...` runs each in its own process, in turns, ROUNDS rounds
(default 2) of REPEAT timed streaming diffs (default 5); prints each run's plain and streaming medians.
`OLD=OLD_ROOT bash bench/gpu.sh ab` runs it against this tree."""
import os
import statistics
import subprocess
import sys

if len(sys.argv) > 2 or sys.argv[1:] == []:
    for _ in range(int(os.environ.get("ROUNDS", 2))):
        for root in sys.argv[1:]:
            subprocess.run([sys.executable, __file__, root], check=False)
    sys.exit(0)
root = os.path.abspath(sys.argv[1])
sys.path.insert(0, root)
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
from stream_pair import StreamPair, timed  # noqa: E402  (sets the model's size in the environment)
import diffkit  # noqa: E402

bench = StreamPair(diffkit)
plain, st = bench.plain, bench.stream
plain(), st()
p = [timed(plain) for _ in range(3)]
s = [timed(st) for _ in range(int(os.environ.get("REPEAT", 5)))]
r = st()
print(f"{sys.argv[1]}: plain {statistics.median(p):.3f} s, stream {statistics.median(s):.3f} s "
      f"({statistics.median(s) / statistics.median(p):.2f}x) runs {[round(x, 3) for x in s]} {r.verdict} "
      f"{r.meta.get('lockstep')} {diffkit.__file__}", flush=True)

"""Profile every Python process started with this folder on PYTHONPATH, two ways:

* DIFFKIT_PROFILE_DIR: each process writes <pid>.prof (cProfile: the main thread only) and <pid>.txt (its command
  line, start and end times) there at exit.
* DIFFKIT_SAMPLE_DIR: a thread samples every thread's Python stack every DIFFKIT_SAMPLE_MS (default 5) and writes
  <pid>.samples.txt (which functions the busy threads were in, inclusive, and the innermost lines, and the main
  thread's timeline) every DIFFKIT_SAMPLE_WRITE_S (default 0.5) seconds and at exit.  Forked children start a
  sampler of their own (`os.register_at_fork`): an isolated diff's child, forked from the CLI and stopped once it
  has answered (its exit handlers never run), is covered too, and so is the diff's work on its worker threads,
  which cProfile does not see.

Used by `bash bench/gpu.sh profile` to see where an isolated diff's processes spend their time."""
import os

_DIR = os.environ.get("DIFFKIT_PROFILE_DIR")
if _DIR:
    import atexit
    import cProfile
    import sys
    import time

    _start = time.time()
    _prof = cProfile.Profile()
    _prof.enable()

    def _dump():
        _prof.disable()
        _prof.dump_stats(os.path.join(_DIR, f"{os.getpid()}.prof"))
        with open(os.path.join(_DIR, f"{os.getpid()}.txt"), "w") as fh:
            fh.write(f"{' '.join(sys.argv)}\nstart {_start:.3f}\nend {time.time():.3f}\n")

    atexit.register(_dump)
    _real_exit = os._exit

    def _exit_dumping(code):  # a process that leaves without its atexit handlers (os._exit) is profiled too
        try:
            _dump()
        finally:
            _real_exit(code)

    os._exit = _exit_dumping

_SAMPLES = os.environ.get("DIFFKIT_SAMPLE_DIR")
if _SAMPLES:
    import atexit
    import collections
    import sys
    import threading
    import time

    # the functions a timeline names (the innermost of these a main-thread sample is in); DIFFKIT_SAMPLE_PHASES adds
    # more
    _PHASES = {"load_pair", "_construct", "run_trials", "_diff_once", "_run_side", "streaming_traces", "health",
               "second_run", "align", "locate", "explain", "write_reports", "render", "_forked_child",
               "one_child_first", "per_side", "_preload", "library", "finish", "main", "diff_files", "packed_batch",
               "_do_compile",
               *filter(None, os.environ.get("DIFFKIT_SAMPLE_PHASES", "").split(","))}
    # innermost frames of a thread that is waiting, not working
    _IDLE = {"wait", "select", "poll", "acquire", "get", "sleep", "_wait_for_tstate_lock", "recv", "recv_bytes",
             "_recv", "_recv_bytes", "read", "accept", "join", "communicate", "_communicate", "_try_wait",
             "waitpid"}

    class _Sampler:
        def __init__(self):
            self.start = time.time()
            self.busy = collections.Counter()  # function -> seconds in which a working thread was inside it
            self.inner = collections.Counter()  # innermost file:line of working threads -> seconds
            self.n = self.idle = 0
            self.idle_s = 0.0
            self.spans: list[list] = []  # [start, end, label] of the main thread, in time.time()
            self.stop = False
            self.thread = threading.Thread(target=self.loop, name="diffkit-sampler", daemon=True)
            self.thread.start()

        def loop(self):
            every = float(os.environ.get("DIFFKIT_SAMPLE_MS", "5")) / 1000
            me, last = threading.get_ident(), time.time()
            main = threading.main_thread().ident  # (in a forked child: the thread that forked)
            prev = time.time()
            while not self.stop:
                time.sleep(every)
                now = time.time()
                dt, prev = now - prev, now  # each sample stands for the time since the last (the loop's own cost too)
                for tid, f in sys._current_frames().items():
                    if tid == me:
                        continue
                    self.n += 1
                    if tid == main:
                        self.mark(now, f)
                    if f.f_code.co_name in _IDLE:
                        self.idle += 1
                        self.idle_s += dt
                        continue
                    self.inner[f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"] += dt
                    seen = set()
                    while f is not None:
                        key = f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_firstlineno} {f.f_code.co_name}"
                        if key not in seen:
                            seen.add(key)
                            self.busy[key] += dt
                        f = f.f_back
                if now - last > _WRITE_S:
                    self.write()
                    last = time.time()

        def mark(self, now, f):
            """The main thread's timeline: the innermost of the named phases it is in (else its innermost frame),
            kept as spans."""
            label, g = None, f
            while g is not None and label is None:
                if g.f_code.co_name in _PHASES:
                    label = g.f_code.co_name
                g = g.f_back
            if label is None:
                label = f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}"
                if f.f_code.co_name in _IDLE:
                    label = "(waiting) " + label
            if self.spans and self.spans[-1][2] == label:
                self.spans[-1][1] = now
            else:
                self.spans.append([now, now, label])

        def write(self):
            every = float(os.environ.get("DIFFKIT_SAMPLE_MS", "5")) / 1000
            path = os.path.join(_SAMPLES, f"{os.getpid()}.samples.txt")
            with open(path + ".tmp", "w") as fh:
                fh.write(f"{' '.join(sys.argv)}\nstarted {self.start:.3f} (epoch); {time.time() - self.start:.2f} s "
                         f"sampled; {self.n} thread samples, {self.idle} idle ({self.idle_s:.2f} s); every ~"
                         f"{every * 1000:.0f} ms, each weighted by the time since the last\n\nbusy, inclusive:\n")
                for k, v in self.busy.most_common(60):
                    fh.write(f"{v:8.2f} s  {k}\n")
                fh.write("\nbusy, innermost line:\n")
                for k, v in self.inner.most_common(30):
                    fh.write(f"{v:8.2f} s  {k}\n")
                fh.write("\ntimeline of the main thread (epoch start, seconds, what; spans of 50 ms and more):\n")
                for a, b, label in self.spans:
                    if b - a >= 0.05:
                        fh.write(f"T {a:.3f} {b - a:7.3f}  {label}\n")
            os.replace(path + ".tmp", path)

    _WRITE_S = float(os.environ.get("DIFFKIT_SAMPLE_WRITE_S", "0.5"))  # (a child stopped once it has answered loses
    # what it did after its last write: a short run wants a shorter interval)
    _sampler = [_Sampler()]

    def _restart():  # a forked child: the parent's sampler thread did not come along
        _sampler[0] = _Sampler()

    os.register_at_fork(after_in_child=_restart)
    atexit.register(lambda: _sampler[0].write())

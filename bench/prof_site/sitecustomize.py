"""Profile every Python process started with this folder on PYTHONPATH, two ways:

* DIFFKIT_PROFILE_DIR: each process writes <pid>.prof (cProfile: the main thread only) and <pid>.txt (its command
  line, start and end times) there at exit.
* DIFFKIT_SAMPLE_DIR: a thread samples every thread's Python stack every DIFFKIT_SAMPLE_MS (default 5) and writes
  <pid>.samples.txt (which functions the busy threads were in, inclusive, and the innermost lines) every half
  second and at exit.  Forked children start a sampler of their own (`os.register_at_fork`): an isolated diff's
  child, forked from the CLI and stopped once it has answered (its exit handlers never run), is covered too, and
  so is the diff's work on its worker threads, which cProfile does not see.

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

    # innermost frames of a thread that is waiting, not working
    _IDLE = {"wait", "select", "poll", "acquire", "get", "sleep", "_wait_for_tstate_lock", "recv", "recv_bytes",
             "_recv", "_recv_bytes", "read", "accept", "join"}

    class _Sampler:
        def __init__(self):
            self.start = time.time()
            self.busy = collections.Counter()  # function -> samples in which a working thread was inside it
            self.inner = collections.Counter()  # innermost file:line of working threads
            self.n = self.idle = 0
            self.stop = False
            self.thread = threading.Thread(target=self.loop, name="diffkit-sampler", daemon=True)
            self.thread.start()

        def loop(self):
            every = float(os.environ.get("DIFFKIT_SAMPLE_MS", "5")) / 1000
            me, last = threading.get_ident(), time.time()
            while not self.stop:
                time.sleep(every)
                for tid, f in sys._current_frames().items():
                    if tid == me:
                        continue
                    self.n += 1
                    if f.f_code.co_name in _IDLE:
                        self.idle += 1
                        continue
                    self.inner[f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"] += 1
                    seen = set()
                    while f is not None:
                        key = f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_firstlineno} {f.f_code.co_name}"
                        if key not in seen:
                            seen.add(key)
                            self.busy[key] += 1
                        f = f.f_back
                if time.time() - last > 0.5:
                    self.write()
                    last = time.time()

        def write(self):
            every = float(os.environ.get("DIFFKIT_SAMPLE_MS", "5")) / 1000
            path = os.path.join(_SAMPLES, f"{os.getpid()}.samples.txt")
            with open(path + ".tmp", "w") as fh:
                fh.write(f"{' '.join(sys.argv)}\n{time.time() - self.start:.2f} s sampled; {self.n} thread samples, "
                         f"{self.idle} idle; a sample ~{every * 1000:.0f} ms of a thread\n\nbusy, inclusive:\n")
                for k, v in self.busy.most_common(60):
                    fh.write(f"{v * every:8.2f} s  {k}\n")
                fh.write("\nbusy, innermost line:\n")
                for k, v in self.inner.most_common(30):
                    fh.write(f"{v * every:8.2f} s  {k}\n")
            os.replace(path + ".tmp", path)

    _sampler = [_Sampler()]

    def _restart():  # a forked child: the parent's sampler thread did not come along
        _sampler[0] = _Sampler()

    os.register_at_fork(after_in_child=_restart)
    atexit.register(lambda: _sampler[0].write())

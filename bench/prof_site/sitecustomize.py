"""Profile every Python process started with this folder on PYTHONPATH and DIFFKIT_PROFILE_DIR set: each
writes <pid>.prof (cProfile) and <pid>.txt (its command line, start and end times) there at exit.
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

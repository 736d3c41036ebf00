"""A busy neighbour as real ones are: it computes in bursts, sleeps, forks
short-lived children and writes and syncs files, on every CPU. CI runs the
suite again beside it (and beside a second suite); a test whose verdict
depends on how busy the host is fails there.

    python tests/support/neighbour.py [PROCESSES]   # until SIGTERM or SIGINT
"""

import os
import random
import signal
import sys
import tempfile
import time


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def work(seed):
    rng = random.Random(seed)
    fd, path = tempfile.mkstemp(prefix="cpupin-neighbour-")
    os.close(fd)
    try:
        while True:
            _spin(rng.uniform(0.001, 0.02))
            pick = rng.random()
            if pick < 0.3:
                time.sleep(rng.uniform(0, 0.01))
            elif pick < 0.4:
                pid = os.fork()
                if pid == 0:
                    _spin(0.005)
                    os._exit(0)
                os.waitpid(pid, 0)
            elif pick < 0.5:
                with open(path, "wb") as f:
                    f.write(os.urandom(1 << 16))
                    f.flush()
                    os.fsync(f.fileno())
    finally:
        os.unlink(path)


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count() or 1
    children = []
    for seed in range(count):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            try:
                work(seed)
            finally:
                os._exit(0)
        children.append(pid)

    def stop(*_):
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in children:
            os.waitpid(pid, 0)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()

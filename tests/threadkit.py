"""Running a test's work in several Python threads at once: an assert raised in a thread fails nothing by itself,
so every exception is collected and handed back with the threads still running after the time limit."""
import threading


def run_in_threads(work, n, timeout):
    """Call ``work(k)`` for k in 0..n-1, each in its own thread, all started before any is joined; returns
    (the reprs of the exceptions raised, the number of threads still alive after ``timeout`` seconds each)."""
    errors = []

    def guarded(k):
        try:
            work(k)
        except Exception as e:   # noqa: BLE001 -- handed back to the test
            errors.append(repr(e))

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors, sum(t.is_alive() for t in threads)

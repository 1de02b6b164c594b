"""Running one piece of work on several real threads at once, with their failures brought back."""
import threading


def run_threads(work, count):
    """Runs work(i) on count threads started together; returns the exceptions they raised."""
    errors, barrier = [], threading.Barrier(count)

    def run(i):
        barrier.wait()
        try:
            work(i)
        except BaseException as error:  # reported on the calling thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors
